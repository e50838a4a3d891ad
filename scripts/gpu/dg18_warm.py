"""Compile (NVRTC, no GPU) the kernels of the dg18 round (issue 18: bf16 M = 128 with C) into the tilehal cache: the
GPU tests of the cluster split-K rule and of the 128 x 32768 x 512 candidate tiles, and the two sweeps of
benchmarks/sweep_small_m.py the job runs (--persistent-tiles on 128 x 32768 x 512 with and without C; --plans
plan_cluster on 128 x 4096 x 7168). The keys are made as cuda_gemm.dense makes them. Run through scripts/gpu/warm.sh
(the device's NVRTC, the device's tree path): scripts/gpu/warm.sh dg18 TREE python3 scripts/gpu/dg18_warm.py"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses

import torch
from deepgemm import cuda_gemm, heuristics, splitk

SMS = 132
BF16, FP32 = torch.bfloat16, torch.float32
WIDE_N_TILES = [(128, 128), (128, 64), (128, 96), (64, 256)]  # tests/test_c_epilogue.py WIDE_N_TILES
TILE_KERNEL_PLANS = [(256, splitk.max_stages(128, 256)), (128, splitk.max_stages(128, 128)), (128, 3)]


def split_keys() -> list:
    m, n, k = 128, 4096, 7168
    keys = []
    for has_c in (True, False):
        base = splitk.pick_splitk(m, n, k, SMS, has_c=has_c)
        for cfg in {base, dataclasses.replace(base, cluster_reduce=not base.cluster_reduce)}:
            for out in (BF16, FP32) if has_c else (BF16,):
                keys.append(splitk.splitk_key(splitk.with_c_early(cfg, has_c), n, k, out, out if has_c else None))
    return keys


def persistent_keys() -> list:
    m, n, k = 128, 32768, 512
    keys = []
    ctma = heuristics.pick_config("bf16", m, n, k, num_sms=SMS, tma_store=True, c_tma=True)
    plain = heuristics.pick_config("bf16", m, n, k, num_sms=SMS, tma_store=True)
    for base, has_c in ((ctma, True), (plain, False)):
        for cfg in [base] + [heuristics.with_tile(base, m, n, bm, bn) for bm, bn in WIDE_N_TILES]:
            keys.append(cuda_gemm.kernel_key(cfg, n, k, "normal", 1, BF16, has_c))
    for bn, stages in TILE_KERNEL_PLANS:  # benchmarks/sweep_small_m.py TILE_KERNEL_PLANS, with the bf16 C = D
        keys.append(splitk.splitk_key(splitk.SplitKConfig(128, bn, 1, stages, SMS), n, k, BF16, BF16))
    return keys


def build(key) -> bool:
    if isinstance(key, splitk.SplitKKey):
        return splitk.compile_kernels([key]).cache_hit
    return cuda_gemm.compile_kernel(key).cache_hit


def main() -> None:
    keys = list(dict.fromkeys(split_keys() + persistent_keys()))
    with cf.ProcessPoolExecutor(2) as ex:
        hits = list(ex.map(build, keys))
    print(f"dg18 warm: {len(keys)} kernels ({sum(hits)} already cached)")


if __name__ == "__main__":
    main()
