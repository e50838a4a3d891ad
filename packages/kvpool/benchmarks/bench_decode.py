# requires: cuda
"""paged_decode on the GPU: KV bandwidth against SDPA on contiguous K/V, and sparse vs dense.

Shapes from the issue: 32 q heads / 8 kv heads, head_dim 128, bf16, block_size 16;
b64 x 4096 and b8 x 32768 tokens (dense), and b8 x 128K tokens with 64 of 8192 blocks per
(sequence, kv head) selected (sparse). Sequences' blocks are interleaved in the pool (appended
round-robin), as in a serving engine. With --record, writes docs/benchmarks/kvpool_decode.{json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import kvpool
import tilehal
import torch
import torch.nn.functional as F
from kvpool import cuda_decode

try:
    from tqdm import tqdm
except ImportError:  # the GPU machine has no tqdm
    def tqdm(it, **_):
        return it

HQ, H, D, BS = 32, 8, 128, 16
OUT_DIR = Path(__file__).resolve().parents[3] / "docs" / "benchmarks"


def build_pool(batch: int, seq_len: int, chunk_blocks: int = 8) -> kvpool.KVPool:
    blocks = batch * seq_len // BS
    pool = kvpool.KVPool(1, H, D, blocks, block_size=BS, dtype=torch.bfloat16, device="cuda",
                         prefix_caching=False, watermark=0.0)
    for b in range(batch):
        pool.add_sequence(b, [0])
    for _ in tqdm(range(seq_len // (BS * chunk_blocks)), desc=f"fill b{batch}x{seq_len}", leave=False):
        for b in range(batch):
            pool.append(b, BS * chunk_blocks)
    pool.k_cache.normal_()
    pool.v_cache.normal_()
    return pool


def contiguous_kv(pool: kvpool.KVPool, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K/V as [B, H, S, D] contiguous tensors (SDPA's input)."""
    ks, vs = [], []
    for b in range(batch):
        k, v = pool.gather(0, b)
        ks.append(k.transpose(0, 1))
        vs.append(v.transpose(0, 1))
    return torch.stack(ks).contiguous(), torch.stack(vs).contiguous()


def bench(fn) -> float:
    return tilehal.bench(fn, warmup=5, iters=30, flush_l2=True).median_s


def bench_graph(fn) -> float | str:
    """GPU time without Python launch overhead (the call captured in a CUDA graph, replayed), or
    why it could not be captured: the JSON says so instead of hiding it."""
    try:
        return tilehal.bench_graph(fn, warmup=5, iters=30, flush_l2=True).median_s
    except Exception as e:
        return f"capture failed: {type(e).__name__}: {e}"[:300]


# Candidates for the default. JSON recorded before 2026-12-01 names them by history: v1 = simt, v3 = mma.
VARIANTS = ("simt", "mma:64:2", "mma:64:3", "mma:64:4")


def dense_case(batch: int, seq_len: int) -> dict:
    pool = build_pool(batch, seq_len)
    ids = list(range(batch))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = contiguous_kv(pool, batch)
    kv_bytes = 2 * batch * seq_len * H * D * 2
    sdpa_out = F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
    default = cuda_decode.default_config()
    ours = kvpool.paged_decode(q, pool, 0, bt, sl)
    diff = tilehal.calc_diff(ours, sdpa_out)
    t_ours = bench(lambda: kvpool.paged_decode(q, pool, 0, bt, sl))
    g_ours = bench_graph(lambda: kvpool.paged_decode(q, pool, 0, bt, sl))
    variants = {}
    for name in VARIANTS:  # every kernel against the same SDPA figure, same run
        cfg = cuda_decode.KernelConfig.parse(name)
        try:
            out = cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, None, config=cfg)
            torch.cuda.synchronize()
        except Exception as e:  # report, do not hide: a broken candidate must not end the run
            variants[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        t = bench(lambda c=cfg: cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, None, config=c))
        g = bench_graph(lambda c=cfg: cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, None, config=c))
        variants[name] = {"us": t * 1e6, "GBps": kv_bytes / t / 1e9, "ratio_vs_sdpa": t_sdpa / t,
                          "cuda_graph_GBps": kv_bytes / g / 1e9 if isinstance(g, float) else g,
                          "calc_diff_vs_sdpa": tilehal.calc_diff(out, sdpa_out)}
    sweep = {}
    best = max((n for n in variants if "GBps" in variants[n] and variants[n]["calc_diff_vs_sdpa"] < 1e-4),
               key=lambda n: variants[n]["GBps"], default="simt")
    best_cfg = cuda_decode.KernelConfig.parse(best)
    for splits in (1, 2, 4, 8, 16):  # how much the split heuristic leaves on the table (best variant)
        t = bench(lambda s=splits: cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, None, num_splits=s,
                                                                 config=best_cfg))
        sweep[splits] = kv_bytes / t / 1e9
    return {
        "default_kernel": f"{default.variant}:{default.tile}:{default.stages}",
        "kernel_variants": variants, "fastest_correct_variant": best, "split_sweep_variant": best,
        "cuda_graph_paged_decode_GBps": kv_bytes / g_ours / 1e9 if isinstance(g_ours, float) else g_ours,
        "split_sweep_GBps": sweep,
        "case": f"dense b{batch} x {seq_len}", "batch": batch, "seq_len": seq_len, "kv_bytes": kv_bytes,
        "paged_decode_us": t_ours * 1e6, "sdpa_contiguous_us": t_sdpa * 1e6,
        "paged_decode_GBps": kv_bytes / t_ours / 1e9, "sdpa_contiguous_GBps": kv_bytes / t_sdpa / 1e9,
        "bandwidth_ratio": t_sdpa / t_ours, "calc_diff_vs_sdpa": diff,
    }


def sparse_case(batch: int, seq_len: int, selected: int) -> dict:
    pool = build_pool(batch, seq_len, chunk_blocks=64)
    ids = list(range(batch))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    nb = seq_len // BS
    bi = torch.stack([torch.randperm(nb, device="cuda")[:selected].sort().values for _ in range(batch * H)])
    bi = bi.view(batch, H, selected).int().contiguous()
    sparse = kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=bi)
    ref = kvpool.paged_decode_reference(q[:1], pool, 0, bt[:1], sl[:1], block_indices=bi[:1])
    diff = tilehal.calc_diff(sparse[:1], ref)
    t_dense = bench(lambda: kvpool.paged_decode(q, pool, 0, bt, sl))
    t_sparse = bench(lambda: kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=bi))
    g_dense = bench_graph(lambda: kvpool.paged_decode(q, pool, 0, bt, sl))
    g_sparse = bench_graph(lambda: kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=bi))
    sparse_bytes = 2 * batch * H * selected * BS * D * 2
    variants = {}
    for name in ("simt", "mma:64:3"):
        cfg = cuda_decode.KernelConfig.parse(name)
        try:
            d_v = tilehal.calc_diff(cuda_decode.paged_decode_cuda(q[:1], pool, 0, bt[:1], sl[:1], None, bi[:1],
                                                                  config=cfg), ref)
            t_s = bench(lambda c=cfg: cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, bi, config=c))
            t_d = bench(lambda c=cfg: cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, None, config=c))
            variants[name] = {"sparse_us": t_s * 1e6, "dense_us": t_d * 1e6, "speedup": t_d / t_s,
                              "calc_diff_vs_reference": d_v}
        except Exception as e:
            variants[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return {
        "kernel_variants": variants,
        "case": f"sparse b{batch} x {seq_len}, {selected}/{nb} blocks", "batch": batch, "seq_len": seq_len,
        "selected_blocks": selected, "total_blocks": nb,
        "dense_paged_us": t_dense * 1e6, "sparse_paged_us": t_sparse * 1e6, "speedup": t_dense / t_sparse,
        "cuda_graph_dense_us": g_dense * 1e6 if isinstance(g_dense, float) else g_dense,
        "cuda_graph_sparse_us": g_sparse * 1e6 if isinstance(g_sparse, float) else g_sparse,
        "cuda_graph_speedup": g_dense / g_sparse if isinstance(g_dense, float) and isinstance(g_sparse, float) else None,
        "dense_GBps": 2 * batch * seq_len * H * D * 2 / t_dense / 1e9, "sparse_GBps": sparse_bytes / t_sparse / 1e9,
        "calc_diff_vs_reference": diff,
    }


def plot(result: dict, out: Path) -> None:
    """PNG from the JSON (also runnable later: --plot-only, where the GPU box lacks matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing: no PNG (run --plot-only elsewhere)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, sparse = result["dense"], result["sparse"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["case"] for r in rows]
    x = range(len(rows))
    names_v = [n for n in rows[0]["kernel_variants"] if all("GBps" in r["kernel_variants"].get(n, {}) for r in rows)]
    width = 0.8 / (len(names_v) + 1)
    for j, n in enumerate(names_v):
        a1.bar([i - 0.4 + j * width for i in x], [r["kernel_variants"][n]["GBps"] for r in rows], width,
               label=f"paged_decode {n}")
    a1.bar([i - 0.4 + len(names_v) * width for i in x], [r["sdpa_contiguous_GBps"] for r in rows], width,
           label="SDPA, contiguous K/V", color="black")
    a1.set_xticks(list(x), names)
    a1.set_ylabel("K/V read bandwidth (GB/s)")
    a1.legend(fontsize=7)
    a2.bar(["dense paged", "sparse 64/8192"], [sparse["dense_paged_us"], sparse["sparse_paged_us"]])
    a2.set_yscale("log")
    a2.set_ylabel("time (us, log)")
    a2.set_title(f"b8 x 128K: {sparse['speedup']:.0f}x")
    fig.suptitle(f"kvpool decode, {result['machine']['gpu']}, GQA 32/8, d128, bf16")
    fig.tight_layout()
    fig.savefig(out / "kvpool_decode.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true", help="write the results into docs/benchmarks/ (default: print only)")
    ap.add_argument("--out", type=Path, default=None, help="write the results into this folder instead")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG from an existing JSON")
    args = ap.parse_args()
    if args.out is None and (args.record or args.plot_only):
        args.out = OUT_DIR
    if args.plot_only:
        plot(json.loads((args.out / "kvpool_decode.json").read_text()), args.out)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA GPU")
    rows = [dense_case(64, 4096), dense_case(8, 32768)]
    torch.cuda.empty_cache()
    sparse = sparse_case(8, 131072, 64)
    print(f"{'case':<24}{'paged_decode':>14}{'SDPA contig':>14}{'ours GB/s':>11}{'SDPA GB/s':>11}{'ratio':>7}")
    for r in rows:
        print(f"{r['case']:<24}{r['paged_decode_us']:>12.1f}us{r['sdpa_contiguous_us']:>12.1f}us"
              f"{r['paged_decode_GBps']:>11.0f}{r['sdpa_contiguous_GBps']:>11.0f}{r['bandwidth_ratio']:>7.2f}")
    print(f"{sparse['case']}: dense {sparse['dense_paged_us']:.1f} us, sparse {sparse['sparse_paged_us']:.1f} us, "
          f"speedup {sparse['speedup']:.1f}x; CUDA graph: {sparse['cuda_graph_dense_us']} / "
          f"{sparse['cuda_graph_sparse_us']} us")
    for r in rows:
        print(f"{r['case']} (default {r['default_kernel']}): graph GB/s {r['cuda_graph_paged_decode_GBps']:.0f}; "
              f"split sweep of {r['split_sweep_variant']} GB/s", {k: round(v) for k, v in r["split_sweep_GBps"].items()})
        for name, vr in r["kernel_variants"].items():
            if "error" in vr:
                print(f"  {name:<10} ERROR {vr['error']}")
            else:
                print(f"  {name:<10} {vr['us']:8.1f} us {vr['GBps']:7.0f} GB/s ({vr['ratio_vs_sdpa']:.2f}x SDPA), "
                      f"graph {vr['cuda_graph_GBps'] if isinstance(vr['cuda_graph_GBps'], str) else round(vr['cuda_graph_GBps'])}"
                      f" GB/s, calc_diff {vr['calc_diff_vs_sdpa']:.1e}")
    print("sparse variants", sparse["kernel_variants"])
    result = {
        "benchmark": "kvpool paged_decode", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node()},
        "config": {"q_heads": HQ, "kv_heads": H, "head_dim": D, "block_size": BS, "dtype": "bfloat16",
                   "timer": "CUDA events, median of 30 after 5 warm-up, L2 flushed"},
        "dense": rows, "sparse": sparse,
    }
    if args.out is None:
        print("not recorded (pass --record to write docs/benchmarks/kvpool_decode.json)")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kvpool_decode.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out)
    print(f"wrote {args.out / 'kvpool_decode.json'}")


if __name__ == "__main__":
    main()
