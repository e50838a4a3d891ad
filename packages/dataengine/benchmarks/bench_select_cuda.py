# requires: cuda, kvpool (the consumer of the selection; this script composes the two like tests/ does)
"""GPU block selection and one sparse decode step, against dense paged decode, same run.

Shapes from issue 15: b8, GQA 32/8, head_dim 128, bf16, 16-token blocks; selection of 64 blocks
(sink 1, local 1) per (sequence, kv head) from Quest bounds over kvpool's key summaries.
  selection    select_blocks (2 kernels) at 128K tokens (8192 blocks), eager GPU time and CUDA
               graph replay; the torch reference (select_blocks_reference) in the same run.
  step         select_blocks + paged_decode(block_indices=...) vs dense paged_decode, context
               8K..128K (one pool of 128K tokens per sequence, blocks interleaved; shorter
               contexts use the first blocks), eager and CUDA graph.
Floor: the selection reads the summaries, 2 * kv_heads * head_dim * 2 B per block per sequence
(268 MB at b8 x 128K) = 1/16 of what dense decode reads (K and V); the JSON gives both.
Writes docs/benchmarks/dataengine_select_cuda_kernels.{json,png}.
"""

from __future__ import annotations

import json
import os
import sys

import kvpool
import tilehal
import torch
from _common import out_dir, write_json
from dataengine import cuda_select, select

HQ, H, D, BS, B, TOP = 32, 8, 128, 16, 8, 64
CTX_MAX = 128 * 1024


def bench(fn) -> float:
    return tilehal.bench(fn, warmup=5, iters=30, flush_l2=True).median_s


def bench_graph(fn) -> float | str:
    """GPU time without Python launch overhead (the call captured in a CUDA graph, replayed), or
    why it could not be captured: the JSON says so instead of hiding it."""
    try:
        return tilehal.bench_graph(fn, warmup=5, iters=30, flush_l2=True).median_s
    except Exception as e:
        return f"capture failed: {type(e).__name__}: {e}"[:300]


def build_pool() -> kvpool.KVPool:
    pool = kvpool.KVPool(1, H, D, B * CTX_MAX // BS, block_size=BS, dtype=torch.bfloat16, device="cuda",
                         prefix_caching=False, watermark=0.0)
    for b in range(B):
        pool.add_sequence(b, [0])
    for _ in range(CTX_MAX // (BS * 64)):
        for b in range(B):
            pool.append(b, BS * 64)
    pool.k_cache.normal_()
    pool.v_cache.normal_()
    kmin, kmax = pool.key_summary(0)
    k = pool.k_cache[0].view(-1, BS, H, D)
    for s in range(0, k.shape[0], 8192):  # summaries of the random keys, as writes would leave them
        kmin[s:s + 8192] = k[s:s + 8192].amin(1)
        kmax[s:s + 8192] = k[s:s + 8192].amax(1)
    return pool


def us(x):
    return round(x * 1e6, 2) if isinstance(x, float) else x


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_select_cuda needs a CUDA GPU")
    pool = build_pool()
    ids = list(range(B))
    bt_full = pool.block_table(ids)
    kmin, kmax = pool.key_summary(0)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    rows = []
    sel_row = None
    for ctx in (8192, 16384, 32768, 65536, 131072):
        nb = ctx // BS
        bt = bt_full[:, :nb].contiguous()
        sl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")

        def sel(bt=bt, sl=sl):
            return select.select_blocks(q, kmin, kmax, bt, sl, TOP, 1, 1, block_size=BS)

        def step(bt=bt, sl=sl):
            return kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=sel(bt, sl))

        def dense(bt=bt, sl=sl):
            return kvpool.paged_decode(q, pool, 0, bt, sl)

        idx = sel()
        ref = select.select_blocks_reference(q, kmin, kmax, bt, sl, TOP, 1, 1, block_size=BS)
        same = bool(torch.equal(idx, ref))
        mismatch_rows = int((idx != ref).any(-1).sum())
        out_sparse = step()
        out_ref = kvpool.paged_decode_reference(q[:1], pool, 0, bt[:1], sl[:1], block_indices=idx[:1])
        t_sel, t_step, t_dense = bench(sel), bench(step), bench(dense)
        g_sel, g_step, g_dense = bench_graph(sel), bench_graph(step), bench_graph(dense)
        summary_bytes = 2 * B * nb * H * D * 2
        kv_bytes = 2 * B * ctx * H * D * 2
        row = {"context": ctx, "blocks": nb, "select_us": us(t_sel), "select_graph_us": us(g_sel),
               "sparse_step_us": us(t_step), "sparse_step_graph_us": us(g_step),
               "dense_decode_us": us(t_dense), "dense_decode_graph_us": us(g_dense),
               "step_speedup": round(t_dense / t_step, 2),
               "step_speedup_graph": round(g_dense / g_step, 2) if isinstance(g_step, float) and isinstance(g_dense, float) else None,
               "select_summary_GBps": round(summary_bytes / t_sel / 1e9), "summary_bytes": summary_bytes,
               "dense_kv_bytes": kv_bytes, "floor_speedup_at_dense_bandwidth": round(kv_bytes / summary_bytes, 1),
               "gpu_equals_reference": same, "mismatching_rows": mismatch_rows,
               "sparse_calc_diff_vs_reference": tilehal.calc_diff(out_sparse[:1], out_ref)}
        cuda_select.compile_topk()  # the opt-in top-k variant, same shapes
        try:
            os.environ["DATAENGINE_TOPK_KERNEL"] = "staged"
            staged_ok = bool(torch.equal(sel(), ref))
            row["select_staged_topk_us"] = us(bench(sel))
            row["select_staged_topk_equals_reference"] = staged_ok
        except Exception as e:  # reported, not hidden
            row["select_staged_topk_error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            os.environ.pop("DATAENGINE_TOPK_KERNEL", None)
        if ctx == CTX_MAX:
            t_ref = tilehal.bench(lambda bt=bt, sl=sl: select.select_blocks_reference(q, kmin, kmax, bt, sl, TOP, 1, 1,
                                                                                      block_size=BS),
                                  warmup=2, iters=5).median_s
            row["select_torch_reference_us"] = us(t_ref)
            sel_row = row
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    result = {"benchmark": "dataengine GPU selection + kvpool sparse decode step",
              "config": {"batch": B, "q_heads": HQ, "kv_heads": H, "head_dim": D, "block_size": BS, "top_k": TOP,
                         "sink": 1, "local": 1, "dtype": "bfloat16",
                         "timer": "tilehal.bench: CUDA events, median of 30 after 5 warm-up, L2 flushed"},
              "targets": {"select_us_at_128K": 25, "step_speedup_at_128K": 20},
              "at_128K": sel_row, "curve": rows}
    path = write_json("select_cuda_kernels", result)
    plot(json.loads(path.read_text()))


def plot(result: dict) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["curve"]
    x = [r["context"] // 1024 for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("dense_decode_us", "dense paged decode"), ("sparse_step_us", "select + sparse decode"),
                       ("select_us", "select_blocks (GPU)")):
        a1.plot(x, [r[key] for r in rows], marker="o", label=label)
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("context (K tokens)")
    a1.set_ylabel("GPU time per step (us)")
    a1.legend(fontsize=8)
    a2.plot(x, [r["step_speedup"] for r in rows], marker="o", label="eager GPU time")
    a2.plot(x, [r["step_speedup_graph"] or 0 for r in rows], marker="s", label="CUDA graph")
    a2.plot(x, [r["floor_speedup_at_dense_bandwidth"] for r in rows], ls="--", label="bound: KV bytes / summary bytes")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("context (K tokens)")
    a2.set_ylabel("dense / sparse step")
    a2.legend(fontsize=8)
    fig.suptitle(f"b{B}, GQA 32/8, d128, top {TOP} blocks, {result['machine'].get('gpu', '')}")
    fig.tight_layout()
    fig.savefig(out_dir() / "dataengine_select_cuda_kernels.png", dpi=120)


if __name__ == "__main__":
    if "--plot-only" in sys.argv:
        plot(json.loads((out_dir() / "dataengine_select_cuda_kernels.json").read_text()))
    else:
        main()
