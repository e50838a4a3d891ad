"""Compile (NVRTC, no GPU needed) every kernel the GPU tests and the benchmark will ask for, into the
tilehal compile cache, so a GPU machine with the same NVRTC version spends no time compiling.

The cache key holds the NVRTC major.minor version: warm it with the version the GPU machine has.
    TILESTACK_CACHE_DIR=.dgcache python packages/deepgemm/scripts/warm_cache.py [--jobs 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses

import torch
from deepgemm.cuda_gemm import compile_kernel, kernel_key, staged_store
from deepgemm.heuristics import max_stages, pick_config
from deepgemm.utils import ceil_div, set_num_sms

DENSE_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
GROUPED_NK = [(4096, 7168), (7168, 2048)]
ODD = [(1, 200, 272), (7, 129, 1040), (1000, 200, 272), (1000, 7168, 2048), (130, 24, 128)]
SMS = 132


def dense(keys, kind, m, n, k, out_bf16, has_c, max_multicast=2):
    tma = out_bf16 and not has_c and n % 8 == 0
    staged = staged_store(torch.bfloat16 if out_bf16 else torch.float32, n, has_c, tma)
    cfg = pick_config(kind, m, n, k, num_sms=SMS, tma_store=tma, max_multicast=max_multicast, staged_store=staged)
    keys.add(kernel_key(cfg, n, k, "normal", 1, torch.bfloat16 if out_bf16 else torch.float32, has_c))


def contiguous_m(groups, rows, seed):
    # the row count tests/test_gpu.py::_contiguous_layout builds (same generator, same arithmetic)
    g = torch.Generator().manual_seed(seed)
    counts = [int(rows * (0.7 + 0.3 * torch.rand(1, generator=g).item())) for _ in range(groups)]
    counts[-1] = 0
    return sum(ceil_div(c, 128) * 128 for c in counts)


def masked_expected(groups, m_max, n):
    gen = torch.Generator().manual_seed(groups * 31 + n)
    masked_m = torch.randint(0, m_max + 1, (groups,), generator=gen, dtype=torch.int32)
    masked_m[0] = max(1, int(masked_m[0]))
    return max(1, int(masked_m.float().mean().item()))


def all_keys(max_multicast=2):
    keys = set()
    for kind in ("fp8", "bf16"):
        for m in (64, 128, 4096):
            for n, k in DENSE_NK:
                dense(keys, kind, m, n, k, True, False, max_multicast)
        for m, n, k in ODD:
            dense(keys, kind, m, n, k, False, True, max_multicast)
        for n, k in GROUPED_NK:
            for g, rows in ((4, 8192), (8, 4096)):
                for m in (g * rows, contiguous_m(g, rows, g + n)):
                    cfg = pick_config(kind, m, n, k, num_groups=g, grouping="contiguous", num_sms=SMS,
                                      tma_store=True, max_multicast=max_multicast)
                    keys.add(kernel_key(cfg, n, k, "contiguous", g, torch.bfloat16, False))
            for g, m_max in ((1, 1024), (2, 512), (4, 256)):
                for e in (m_max, masked_expected(g, m_max, n)):
                    cfg = pick_config(kind, min(e, m_max), n, k, num_groups=g, grouping="masked", num_sms=SMS,
                                      max_multicast=max_multicast, staged_store=staged_store(torch.bfloat16, n, False,
                                                                                             False))
                    keys.add(kernel_key(cfg, n, k, "masked", g, torch.bfloat16, False))
    for n, k in DENSE_NK:  # the benchmark's A/B of the overlapped fp8 promotion
        cfg = pick_config("fp8", 4096, n, k, num_sms=SMS, tma_store=True)
        keys.add(kernel_key(dataclasses.replace(cfg, allow_overlap=False), n, k, "normal", 1, torch.bfloat16, False))
    for m, n, k, block_n in ((256, 384, 1408, None), (200, 320, 2496, 88)):  # overlapped-vs-serial GPU test
        cfg = pick_config("fp8", m, n, k, num_sms=SMS, tma_store=True)
        if block_n is not None:
            cfg = dataclasses.replace(cfg, block_n=block_n,
                                      stages=max_stages("fp8", cfg.block_m, block_n, cfg.block_m * block_n * 2))
        for c in (cfg, dataclasses.replace(cfg, allow_overlap=False)):
            keys.add(kernel_key(c, n, k, "normal", 1, torch.bfloat16, False))
    cfg = pick_config("fp8", 128, 512, 512, num_groups=2, grouping="masked", num_sms=SMS,
                      staged_store=staged_store(torch.bfloat16, 512, False, False))  # as the API picks it
    keys.add(kernel_key(cfg, 512, 512, "masked", 2, torch.bfloat16, False))  # CUDA-graph test
    dense(keys, "bf16", 300, 200, 256, False, False)  # gemm() BLAS test: fp32 accumulator output
    for kind in ("fp8", "bf16"):
        cfg = pick_config(kind, 1024, 4096, 1024, num_groups=2, grouping="masked", num_sms=SMS,
                          max_multicast=max_multicast, staged_store=staged_store(torch.bfloat16, 4096, False, False))
        keys.add(kernel_key(cfg, 4096, 1024, "masked", 2, torch.bfloat16, False))  # masked multicast test
        for on_a, (m, n, k) in ((True, (424, 384, 512)), (False, (616, 256, 512))):  # phantom-tile tests
            base = pick_config(kind, m, n, k, num_sms=SMS, tma_store=True, max_multicast=1)
            cfg = dataclasses.replace(base, block_m=128, block_n=128, multicast=2, multicast_on_a=on_a,
                                      stages=max_stages(kind, 128, 128, 128 * 128 * 2))
            keys.add(kernel_key(cfg, n, k, "normal", 1, torch.bfloat16, False))
    return keys


def variant_keys():
    """The configs `bench_gemm.py --variants` times."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_gemm

    keys = set()
    for kind in ("fp8", "bf16"):
        for n, k in DENSE_NK:
            for cfg in bench_gemm.variant_configs(kind, 4096, n, k)[1]:
                keys.add(kernel_key(cfg, n, k, "normal", 1, torch.bfloat16, False))
    return keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", choices=("grouped", "dense", "dense_bf16"), default=None,
                    help="grouped: the contiguous and masked kernels only; dense (dense_bf16): the dense (bf16) ones "
                         "without multicast")
    args = ap.parse_args()
    set_num_sms(SMS)
    keys = all_keys() | all_keys(max_multicast=1) | (set() if args.only else variant_keys())
    keys = sorted(keys, key=lambda k: k.expression)
    if args.only == "grouped":
        keys = [k for k in keys if k.grouping in ("contiguous", "masked") and k.multicast == 1]
    elif args.only in ("dense", "dense_bf16"):
        keys = [k for k in keys if k.grouping == "normal" and k.multicast == 1 and not (args.only == "dense_bf16"
                                                                                     and k.fp8)]
    print(f"{len(keys)} kernels")
    with cf.ProcessPoolExecutor(args.jobs) as ex:
        for i, mod in enumerate(ex.map(compile_kernel, keys)):
            print(f"{i + 1}/{len(keys)} {'hit' if mod.cache_hit else 'built'}", flush=True)


if __name__ == "__main__":
    main()
