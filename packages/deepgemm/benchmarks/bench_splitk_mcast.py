# requires: cuda
"""A/B of the split-K kernel's A multicast (2-CTA clusters along N) at M = 64 / 128, one H200, same run.

At M = 128 every n-block CTA re-reads the A panel over its K range (128 x 2112 x 7168 bf16 with 64-wide tiles:
60 MB of A through L2 for 30 MB of weights); multicast halves A's L2 reads. For each case: the same split-K
config without and with multicast, a wider-tile config both ways, the persistent kernel, and cuBLAS as one
GEMM kernel (torch.mm out= for bf16; `_scaled_mm` per-row for fp8). Timing: tilehal.bench, L2 flushed, median.

    python packages/deepgemm/benchmarks/bench_splitk_mcast.py [--iters 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
from pathlib import Path

import deepgemm
import tilehal
import torch
from deepgemm import cuda_gemm, reference, splitk

# (fp8, M, N, K, [(block_m, block_n, splits), ...]): the configs are timed with multicast 1 and 2.
CASES = [
    (False, 128, 2112, 7168, [(128, 64, 4), (128, 128, 7)]),
    (False, 128, 4096, 7168, [(128, 64, 2), (128, 128, 4)]),
    (False, 128, 576, 7168, [(64, 64, 7), (128, 64, 7)]),
    (True, 128, 2112, 7168, [(64, 64, 2), (128, 64, 4), (128, 128, 7)]),
    (True, 128, 4096, 7168, [(128, 64, 2), (128, 128, 4)]),
    (True, 128, 7168, 16384, [(128, 128, 2)]),
    (True, 64, 2112, 7168, [(64, 64, 4), (64, 128, 7)]),
    (False, 128, 7168, 16384, [(128, 128, 2)]),
    (True, 128, 7168, 2048, [(128, 128, 2)]),
]
ITERS = 20


def configs(fp8: bool, m: int, n: int, k: int, base) -> list[splitk.SplitKConfig]:
    kb = -(-k // (128 if fp8 else 64))
    out = []
    for bm, bn, s in base:
        cfg = splitk.SplitKConfig(bm, bn, splitk.effective_splits(kb, min(s, kb)), splitk.max_stages(bm, bn, fp8), 132,
                                  fp8=fp8)
        out.append(cfg)
        # the multicast twin with the most splits whose padded grid (whole clusters) still fits one wave
        for s2 in range(cfg.splits, 1, -1):
            mc = dataclasses.replace(cfg, multicast=2, splits=splitk.effective_splits(kb, s2))
            gx, gy, gz = mc.grid(m, n)
            if gx * gy * gz <= 132:
                if mc not in out:
                    out.append(mc)
                break
    return out


def keys() -> list:
    out = []
    for fp8, m, n, k, base in CASES:
        for cfg in configs(fp8, m, n, k, base):
            out.append(splitk.splitk_key(cfg, n, k, torch.bfloat16, None, fp8=fp8))
    return out


def timed(fn) -> float:
    return tilehal.bench(fn, warmup=3, iters=ITERS, flush_l2=True).median_s * 1e6


def case(fp8: bool, m: int, n: int, k: int, base) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    r = {"fp8": fp8, "shape": [m, n, k], "configs": {}}
    if fp8:
        a8, sfa = deepgemm.per_token_cast_to_fp8(a)
        b8, sfb = deepgemm.per_block_cast_to_fp8(b)
        sfa_t = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
        ref = reference.fp8_gemm_nt(a8, sfa, b8, sfb, None)

        def run(cfg=None):
            return cuda_gemm.dense(a8, sfa_t, b8, sfb, d, None, config=cfg)

        ones_a, ones_b = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
        r["peer_us"] = timed(lambda: torch._scaled_mm(a8, b8.T, scale_a=ones_a, scale_b=ones_b,
                                                      out_dtype=torch.bfloat16))
        r["peer"] = "scaled_mm_rowwise"
    else:
        ref = reference.bf16_gemm_nt(a, b, None)

        def run(cfg=None):
            return cuda_gemm.dense(a, None, b, None, d, None, config=cfg)

        r["peer_us"] = timed(lambda: torch.mm(a, b.T, out=d))
        r["peer"] = "cublas_mm"
    os.environ["DEEPGEMM_SPLITK"] = "0"
    try:
        r["persistent_us"] = timed(run)
    finally:
        del os.environ["DEEPGEMM_SPLITK"]
    r["default_us"] = timed(run)
    for cfg in configs(fp8, m, n, k, base):
        run(cfg)
        diff = float(deepgemm.testing.calc_diff(d, ref))
        name = f"bm{cfg.block_m}_bn{cfg.block_n}_s{cfg.splits}_mc{cfg.multicast}"
        r["configs"][name] = {"us": timed(lambda cfg=cfg: run(cfg)), "calc_diff": diff}
    cfgs = " ".join(f"{key} {v['us']:.1f}" for key, v in r["configs"].items())
    print(f"{'fp8' if fp8 else 'bf16'} {m}x{n}x{k}: default {r['default_us']:.1f} persistent {r['persistent_us']:.1f} "
          f"{r['peer']} {r['peer_us']:.1f} | {cfgs}", flush=True)
    return r


def main() -> None:
    global ITERS
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=ITERS)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    ITERS = args.iters
    rows = [case(*c) for c in CASES]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "timing": f"tilehal.bench median of {ITERS}, L2 flushed"}
        (args.out / "deepgemm_splitk_mcast_h200.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
