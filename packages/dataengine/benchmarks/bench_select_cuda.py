# requires: cuda, kvpool (the consumer of the selection; this script composes the two like tests/ does)
"""GPU block selection and one sparse decode step, against dense paged decode, same run.

Shapes from issue 15: b8, GQA 32/8, head_dim 128, bf16, 16-token blocks; selection of 64 blocks
(sink 1, local 1) per (sequence, kv head) from Quest bounds over kvpool's key summaries.
  selection    select_blocks (2 kernels) at 128K tokens (8192 blocks), eager GPU time and CUDA
               graph replay; the torch reference (select_blocks_reference) in the same run.
  step         select_blocks + paged_decode(block_indices=...) vs dense paged_decode, context
               8K..128K (one pool of 128K tokens per sequence, blocks interleaved; shorter
               contexts use the first blocks), eager and CUDA graph.
Summaries: bf16 (kvpool's default), fp8 e4m3 rounded outward (KVPool(summary_dtype=
torch.float8_e4m3fn)) and int4 rows (summary_dtype="int4": 80 B per block and head at d128), each timed end to end and split into its two launches (score kernel on CUDA
cores and on tensor cores; top-k fast (1024 threads, 12-bit digits) and plain). select_us is the
default path; select_<path>_us every path (PATHS): two launches or one (DATAENGINE_SELECT_FUSED=1:
quest_select_chunk_kernel, scores + per-chunk top-k + merge by the row's last CTA), scores on the
register path or through per-warp cp.async rings (DATAENGINE_RING_SCORES=on: fp8 on f16 tensor
cores, int4 rows), with their steps at 128K.
Floor: the selection reads the summaries, 2 * kv_heads * row bytes per block per sequence: 2 * 8 *
256 / 128 / 80 B for bf16 / fp8 / int4 at d128 = 268 / 134 / 84 MB at b8 x 128K, 1/16 / 1/32 / 1/51
of what dense decode reads (K and V): 67 / 34 / 21 us at 4.0 TB/s.
Writes docs/benchmarks/dataengine_select_cuda_kernels.{json,png}. BENCH_CONTEXTS=131072 limits the
contexts; BENCH_TORCH_REFERENCE=0 skips timing the torch reference (~20 s at 128K); BENCH_LEAN=1 times only the
main rows (dense, default selection and its step, the other paths' selection) below the largest context.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import kvpool
import tilehal
import torch
from _common import out_dir, write_json
from dataengine import cuda_select, select
from kvpool import cuda_decode
from tilehal.testing import environ

# kvpool's decode benchmark (the consumer's side of the step): its pool builder and timers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kvpool" / "benchmarks"))
import bench_decode as kv_bench  # noqa: E402

bench, bench_graph = kv_bench.bench, kv_bench.bench_graph

HQ, H, D, BS, B, TOP = 32, 8, 128, 16, 8, 64
# the selection paths besides the default (select_us): two launches (scores, top-k) or one
# (quest_select_chunk_kernel), scores on the register path or through the rings (fp8 on f16
# tensor cores, int4)
PATHS = [("two", {"DATAENGINE_SELECT_FUSED": "0", "DATAENGINE_RING_SCORES": "off"}),
         ("two_ring", {"DATAENGINE_SELECT_FUSED": "0", "DATAENGINE_RING_SCORES": "on"}),
         ("fused", {"DATAENGINE_SELECT_FUSED": "1", "DATAENGINE_RING_SCORES": "off"}),
         ("fused_ring", {"DATAENGINE_SELECT_FUSED": "1", "DATAENGINE_RING_SCORES": "on"})]
CTX_MAX = 128 * 1024


def build_pool() -> kvpool.KVPool:
    """kvpool's decode-benchmark pool (B sequences of CTX_MAX tokens, blocks interleaved, random
    K/V) with the summaries of its keys."""
    pool = kv_bench.build_pool(B, CTX_MAX, chunk_blocks=64)
    kmin, kmax = pool.key_summary(0)
    k = pool.k_cache[0].view(-1, BS, H, D)
    for s in range(0, k.shape[0], 8192):  # summaries of the random keys, as writes would leave them
        kmin[s:s + 8192] = k[s:s + 8192].amin(1)
        kmax[s:s + 8192] = k[s:s + 8192].amax(1)
    return pool


def us(x):
    return round(x * 1e6, 2) if isinstance(x, float) else x


def fp8_summaries(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What KVPool(summary_dtype=torch.float8_e4m3fn) keeps for the same keys: outward-rounded codes."""
    from kvpool.storage import FP8_DTYPE, fp8_round_outward

    lo = torch.empty(kmin.shape, dtype=FP8_DTYPE, device=kmin.device)
    hi = torch.empty_like(lo)
    for s in range(0, kmin.shape[0], 8192):
        lo[s:s + 8192] = fp8_round_outward(kmin[s:s + 8192], up=False).view(FP8_DTYPE)
        hi[s:s + 8192] = fp8_round_outward(kmax[s:s + 8192], up=True).view(FP8_DTYPE)
    return lo, hi


def int4_summaries(kmin: torch.Tensor, kmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What KVPool(summary_dtype="int4") keeps for the same keys: int4 rows encoded outward."""
    from kvpool.storage import int4_encode

    lo = torch.empty((*kmin.shape[:2], kmin.shape[2] // 2 + kmin.shape[2] // 8), dtype=torch.uint8, device=kmin.device)
    hi = torch.empty_like(lo)
    for s in range(0, kmin.shape[0], 8192):
        lo[s:s + 8192] = int4_encode(kmin[s:s + 8192].float(), up=False)
        hi[s:s + 8192] = int4_encode(kmax[s:s + 8192].float(), up=True)
    return lo, hi


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_select_cuda needs a CUDA GPU")
    contexts = [int(x) for x in os.environ.get("BENCH_CONTEXTS", "8192,16384,32768,65536,131072").split(",")]
    pool = build_pool()
    ids = list(range(B))
    bt_full = pool.block_table(ids)
    kmin, kmax = pool.key_summary(0)
    summaries = {"bf16": (kmin, kmax), "fp8": fp8_summaries(kmin, kmax), "int4": int4_summaries(kmin, kmax)}
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    rows = []
    sel_row = None
    for ctx in contexts:
        nb = ctx // BS
        bt = bt_full[:, :nb].contiguous()
        sl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")

        def dense(bt=bt, sl=sl):
            return kvpool.paged_decode(q, pool, 0, bt, sl)

        t_dense, g_dense = bench(dense), bench_graph(dense)
        kv_bytes = 2 * B * ctx * H * D * 2
        row = {"context": ctx, "blocks": nb, "dense_decode_us": us(t_dense), "dense_decode_graph_us": us(g_dense),
               "dense_kv_bytes": kv_bytes}
        for name, (lo, hi) in summaries.items():
            def sel(bt=bt, sl=sl, lo=lo, hi=hi):
                return select.select_blocks(q, lo, hi, bt, sl, TOP, 1, 1, block_size=BS)

            def step(bt=bt, sl=sl, sel=sel):
                return kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=sel(bt, sl))

            idx = sel()
            ref = select.select_blocks_reference(q, lo, hi, bt, sl, TOP, 1, 1, block_size=BS)

            def sparse_only(bt=bt, sl=sl, idx=idx):
                return kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=idx)

            lean = os.environ.get("BENCH_LEAN") == "1" and ctx != max(contexts)  # the curve's points: main rows
            if name == "bf16" and not lean:  # the sparse decode's split-K count (heuristic vs fixed counts)
                for ns in (1, 2, 4, 8, 16):
                    row[f"sparse_decode_splits{ns}_us"] = us(bench(
                        lambda bt=bt, sl=sl, idx=idx, ns=ns: cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, idx,
                                                                                            num_splits=ns)))
                row["sparse_decode_graph_us"] = us(bench_graph(sparse_only))
                with environ({"KVPOOL_DECODE_PREFETCH": "1"}):  # the shares' K/V lines into L2 up front
                    row["sparse_decode_prefetch_us"] = us(bench(sparse_only))
                    row["sparse_decode_prefetch_graph_us"] = us(bench_graph(sparse_only))
            out_sparse = step()
            out_ref = kvpool.paged_decode_reference(q[:1], pool, 0, bt[:1], sl[:1], block_indices=idx[:1])
            t_sel, t_step = bench(sel), bench(step)
            g_sel, g_step = bench_graph(sel), bench_graph(step)
            with environ({"KVPOOL_DECODE_PREFETCH": "1"}):
                t_pf, g_pf = bench(step), bench_graph(step)
            sbytes = 2 * B * nb * H * lo.shape[-1] * lo.element_size()
            r = {"select_us": us(t_sel), "select_graph_us": us(g_sel),
                 "sparse_step_prefetch_us": us(t_pf), "sparse_step_prefetch_graph_us": us(g_pf),
                 "step_speedup_prefetch": round(t_dense / t_pf, 2),
                 "step_speedup_prefetch_graph": round(g_dense / g_pf, 2) if isinstance(g_pf, float) and isinstance(g_dense, float) else None,
                 "sparse_step_us": us(t_step), "sparse_step_graph_us": us(g_step),
                 "sparse_decode_only_us": us(bench(sparse_only)),
                 "step_speedup": round(t_dense / t_step, 2),
                 "step_speedup_graph": round(g_dense / g_step, 2) if isinstance(g_step, float) and isinstance(g_dense, float) else None,
                 "summary_bytes": sbytes, "select_summary_GBps": round(sbytes / t_sel / 1e9),
                 "floor_speedup_at_dense_bandwidth": round(kv_bytes / sbytes, 1),
                 "gpu_equals_reference": bool(torch.equal(idx, ref)), "mismatching_rows": int((idx != ref).any(-1).sum()),
                 "sparse_calc_diff_vs_reference": tilehal.calc_diff(out_sparse[:1], out_ref)}
            # every other selection path: two launches / one (fused), register / ring scores
            for pname, env in PATHS:
                if pname.endswith("_ring") and lo.dtype == torch.bfloat16:
                    continue  # rings: fp8 and int4 summaries
                with environ(env):
                    r[f"select_{pname}_us"] = us(bench(sel))
                    r[f"select_{pname}_equals_reference"] = bool(torch.equal(sel(), ref))
                    if not lean:
                        r[f"select_{pname}_graph_us"] = us(bench_graph(sel))
                        t_p, g_p = bench(step), bench_graph(step)
                        r[f"sparse_step_{pname}_us"], r[f"sparse_step_{pname}_graph_us"] = us(t_p), us(g_p)
                        r[f"step_speedup_{pname}"] = round(t_dense / t_p, 2)
            # the two launches apart: score kernel (each variant) and top-k
            raw = cuda_select.quest_raw_scores(q, lo, hi, bt, "max")
            for variant in (() if lean else ("simt", "mma")):
                if (variant == "mma" and cuda_select.mma_reason(q, lo) is not None) or (
                        variant == "simt" and lo.dtype == torch.uint8):
                    continue
                t = bench(lambda bt=bt, lo=lo, hi=hi, v=variant: cuda_select.quest_raw_scores(q, lo, hi, bt, "max", v))
                r[f"score_{variant}_us"] = us(t)
                r[f"score_{variant}_GBps"] = round(sbytes / t / 1e9)
                other = cuda_select.quest_raw_scores(q, lo, hi, bt, "max", variant)
                fin = torch.isfinite(raw)
                r[f"score_{variant}_max_rel_diff_vs_default"] = float(
                    ((other[fin] - raw[fin]).abs() / (1 + raw[fin].abs())).max()) if bool(fin.any()) else 0.0
            for tv in (() if lean else ("fast", "plain")):
                r[f"topk_{tv}_us"] = us(bench(lambda raw=raw, sl=sl, tv=tv: cuda_select.topk_rows(
                    raw, TOP, H, 1, 1, seq_lens=sl, block_size=BS, variant=tv)))
            if ctx == max(contexts) and name == "bf16" and os.environ.get("BENCH_TORCH_REFERENCE", "1") == "1":
                r["select_torch_reference_us"] = us(tilehal.bench(
                    lambda bt=bt, sl=sl, lo=lo, hi=hi: select.select_blocks_reference(q, lo, hi, bt, sl, TOP, 1, 1,
                                                                                      block_size=BS),
                    warmup=2, iters=5).median_s)
            row[name] = r
        if ctx == max(contexts):
            sel_row = row
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    result = {"benchmark": "dataengine GPU selection + kvpool sparse decode step, bf16 and fp8 key summaries",
              "config": {"batch": B, "q_heads": HQ, "kv_heads": H, "head_dim": D, "block_size": BS, "top_k": TOP,
                         "sink": 1, "local": 1, "dtype": "bfloat16", "summaries": list(summaries),
                         "timer": "tilehal.bench: CUDA events, median of 30 after 5 warm-up, L2 flushed"},
              "targets": {"select_us_at_128K": 25, "step_speedup_at_128K": 20},
              "at_128K": sel_row, "curve": rows}
    path = write_json("select_cuda_kernels", result)
    if path is not None:
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
    a1.plot(x, [r["dense_decode_us"] for r in rows], marker="o", label="dense paged decode")
    for name in result["config"].get("summaries", ["bf16"]):
        a1.plot(x, [r[name]["sparse_step_us"] for r in rows], marker="o", label=f"select + sparse decode ({name} summaries)")
        a1.plot(x, [r[name]["select_us"] for r in rows], marker=".", ls=":", label=f"select_blocks ({name} summaries)")
        a2.plot(x, [r[name]["step_speedup"] for r in rows], marker="o", label=f"{name} summaries, eager GPU time")
        a2.plot(x, [r[name]["step_speedup_graph"] or 0 for r in rows], marker="s", label=f"{name} summaries, CUDA graph")
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("context (K tokens)")
    a1.set_ylabel("GPU time per step (us)")
    a1.legend(fontsize=7)
    a2.axhline(result["targets"]["step_speedup_at_128K"], ls="--", color="gray", label="target at 128K")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("context (K tokens)")
    a2.set_ylabel("dense / sparse step")
    a2.legend(fontsize=7)
    fig.suptitle(f"b{B}, GQA 32/8, d128, top {TOP} blocks, {result['machine'].get('gpu', '')}")
    fig.tight_layout()
    fig.savefig(out_dir() / "dataengine_select_cuda_kernels.png", dpi=120)


if __name__ == "__main__":
    if "--plot-only" in sys.argv:
        plot(json.loads((out_dir() / "dataengine_select_cuda_kernels.json").read_text()))
    else:
        main()
