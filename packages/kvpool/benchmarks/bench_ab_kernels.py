# requires: cuda
"""A/B of kvpool's kernel headers: this tree's kernels/ against another copy (e.g. an older
revision's, `git archive REV packages/kvpool/src/kvpool/kernels`), same run, interleaved rounds.

A refactor that changes the generated code (a shared `__device__` helper, say) is checked here for
speed: dense paged decode (b8 x 32K), sparse decode (b8 x 128K, 64 of 8192 blocks per kv head), fp8
decode (b8 x 32K) and the mma.sync prefill kernel w8x2 (one 32K causal prompt); GQA 32/8, d128, bf16,
block 16; tilehal.bench medians (CUDA events, L2 flushed). Output: one JSON line per case and a
JSON file (--out).

  python bench_ab_kernels.py --before /tmp/kernels_before [--cases decode,sparse,fp8,prefill] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import kvpool
import tilehal
import torch
from kvpool import cuda_decode, cuda_prefill

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import BS, HQ, D, H, build_pool  # noqa: E402

AFTER = cuda_decode.KERNEL_DIR


def use_kernels(path: Path) -> None:
    """Point the decode and prefill compilers at `path` (tilehal's cache keys cover the header
    folder, so each side gets its own cubins) and drop the in-process kernel caches."""
    cuda_decode.KERNEL_DIR = cuda_prefill.KERNEL_DIR = path
    for f in (cuda_decode.compile_decode, cuda_decode.compile_decode_fp8, cuda_decode._launch_plan,
              cuda_prefill.compile_prefill):
        f.cache_clear()


def time_us(fn, iters: int = 30) -> float:
    return tilehal.bench(fn, warmup=3, iters=iters, flush_l2=True).median_s * 1e6


def cases(names: list[str]):
    out = {}
    q8 = torch.randn(8, HQ, D, device="cuda", dtype=torch.bfloat16)
    if "decode" in names:
        pool = build_pool(8, 32768, chunk_blocks=64)
        bt, sl = pool.block_table(list(range(8))), pool.seq_lens(list(range(8)))
        out["dense decode b8 x 32K"] = lambda: kvpool.paged_decode(q8, pool, 0, bt, sl)
    if "sparse" in names:
        sp = build_pool(8, 131072, chunk_blocks=64)
        sbt, ssl = sp.block_table(list(range(8))), sp.seq_lens(list(range(8)))
        g = torch.Generator(device="cuda").manual_seed(0)
        bi = torch.stack([torch.randperm(8192, device="cuda", generator=g)[:64].sort().values for _ in range(8 * H)])
        bi = bi.view(8, H, 64).int().contiguous()
        out["sparse decode b8 x 128K, 64/8192 blocks"] = lambda: kvpool.paged_decode(q8, sp, 0, sbt, ssl, block_indices=bi)
    if "fp8" in names:
        fp = kvpool.KVPool(1, H, D, 8 * 32768 // BS, block_size=BS, dtype=torch.float8_e4m3fn, device="cuda",
                           prefix_caching=False, watermark=0.0)
        for b in range(8):
            fp.add_sequence(b, [0])
            fp.append(b, 32768)
        fp.k_cache.view(torch.uint8).copy_(torch.randn(fp.k_cache.shape, device="cuda").to(fp.dtype).view(torch.uint8))
        fp.v_cache.view(torch.uint8).copy_(torch.randn(fp.v_cache.shape, device="cuda").to(fp.dtype).view(torch.uint8))
        fbt, fsl = fp.block_table(list(range(8))), fp.seq_lens(list(range(8)))
        out["fp8 decode b8 x 32K"] = lambda: kvpool.paged_decode(q8, fp, 0, fbt, fsl)
    if "prefill" in names:
        pp = build_pool(1, 32768, chunk_blocks=64)
        pbt, psl = pp.block_table([0]), pp.seq_lens([0])
        cu = torch.tensor([0, 32768], dtype=torch.int32, device="cuda")
        qp = torch.randn(32768, HQ, D, device="cuda", dtype=torch.bfloat16)
        cul, sll = cu.tolist(), psl.tolist()
        out["prefill 32K causal (mma.sync w8x2)"] = \
            lambda: cuda_prefill.paged_prefill_cuda(qp, pp, 0, pbt, psl, cu, cul, sll, None, config=(8, 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True, help="the other kernels/ folder")
    ap.add_argument("--cases", default="decode,sparse,fp8,prefill")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    sides = {"before": a.before.resolve(), "after": AFTER}
    fns = cases(a.cases.split(","))
    res = {name: {"before_us": [], "after_us": []} for name in fns}
    for side, path in sides.items():  # compile both sides first, and check they agree
        use_kernels(path)
        for name, fn in fns.items():
            res[name][f"{side}_out"] = fn().float()
    for name in fns:
        r = res[name]
        r["calc_diff_before_vs_after"] = tilehal.calc_diff(r.pop("before_out"), r.pop("after_out"))
    for _ in range(a.rounds):
        for side, path in sides.items():
            use_kernels(path)
            for name, fn in fns.items():
                res[name][f"{side}_us"].append(time_us(fn, iters=10 if "prefill" in name else 30))
    for name, r in res.items():
        r["before_median_us"] = statistics.median(r["before_us"])
        r["after_median_us"] = statistics.median(r["after_us"])
        r["after_vs_before"] = r["before_median_us"] / r["after_median_us"]
        print(json.dumps({"case": name, **r}), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"benchmark": "kvpool kernel headers A/B", "before": str(a.before),
                                     "date": datetime.datetime.now().isoformat(timespec="seconds"),
                                     "gpu": torch.cuda.get_device_name(), "rounds": a.rounds, "cases": res}, indent=2))


if __name__ == "__main__":
    main()
