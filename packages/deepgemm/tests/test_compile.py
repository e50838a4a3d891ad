"""Compile-only (NVRTC, no GPU): tilehal's Hopper headers, and every kernel configuration the
heuristic picks for the issue's shape sets. Runs in CI on the CPU machine."""

import dataclasses

import pytest
import tilehal
import torch
from deepgemm.cuda_gemm import OPTIONS, kernel_key, kernel_options, kernel_source
from deepgemm.heuristics import max_stages, pick_config

pytestmark = pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")

DENSE_NK = [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]
GROUPED_NK = [(4096, 7168), (7168, 2048)]


def issue_configs():
    keys = set()
    for kind in ("fp8", "bf16"):
        for m in (1, 7, 64, 128, 1000, 4096):
            for n, k in DENSE_NK:
                for out in (torch.bfloat16, torch.float32):  # bf16: TMA-store epilogue; fp32 + C: direct
                    cfg = pick_config(kind, m, n, k, num_sms=132, tma_store=out == torch.bfloat16,
                                      staged_store=4 if out == torch.float32 else 0)  # fp32 + C: staged copy-out
                    keys.add(kernel_key(cfg, n, k, "normal", 1, out, has_c=out == torch.float32))
        for n, k in GROUPED_NK:
            for g, rows in ((4, 8192), (8, 4096)):
                cfg = pick_config(kind, g * rows, n, k, num_groups=g, grouping="contiguous", num_sms=132,
                                  tma_store=True)
                keys.add(kernel_key(cfg, n, k, "contiguous", g, torch.bfloat16, False))
            for g, rows in ((1, 1024), (2, 512), (4, 256)):
                cfg = pick_config(kind, rows, n, k, num_groups=g, grouping="masked", num_sms=132, staged_store=2)
                keys.add(kernel_key(cfg, n, k, "masked", g, torch.bfloat16, False))
    # DEEPGEMM_MULTICAST=2 (multicast allowed) for the large shapes, as the benchmark variants use it
    for kind in ("fp8", "bf16"):
        for n, k in DENSE_NK:
            cfg = pick_config(kind, 4096, n, k, num_sms=132, tma_store=True, max_multicast=2)
            keys.add(kernel_key(cfg, n, k, "normal", 1, torch.bfloat16, False))
    # the serial-promotion twins of the overlapped fp8 kernels (DEEPGEMM_FP8_OVERLAP=0, the benchmark's A/B)
    for n, k in DENSE_NK:
        cfg = pick_config("fp8", 4096, n, k, num_sms=132, tma_store=True, overlap=False)
        keys.add(kernel_key(cfg, n, k, "normal", 1, torch.bfloat16, False))
    for n, k in GROUPED_NK:
        cfg = pick_config("fp8", 1024, n, k, num_groups=1, grouping="masked", num_sms=132, overlap=False,
                          staged_store=2)
        keys.add(kernel_key(cfg, n, k, "masked", 1, torch.bfloat16, False))
    # overlapped fp8 tiles the heuristic does not pick for these shapes: every width class up to 128,
    # K-block counts that leave group tails of 1..7 (the group is 8 blocks), a tile across two scale blocks
    for bn, k in ((8, 128), (24, 256), (56, 384), (96, 640), (80, 1408), (128, 2496), (72, 1920), (64, 1792)):
        base = pick_config("fp8", 256, 1024, k, num_sms=132, tma_store=True)
        cfg = dataclasses.replace(base, block_n=bn, stages=max_stages("fp8", base.block_m, bn, base.block_m * bn * 2))
        keys.add(kernel_key(cfg, 1024, k, "normal", 1, torch.bfloat16, False))
    # odd shapes the GPU tests use
    for kind, m, n, k in (("fp8", 7, 200, 272), ("bf16", 1000, 200, 272), ("fp8", 1000, 129, 1040)):
        cfg = pick_config(kind, m, n, k, num_sms=132, tma_store=n % 8 == 0)
        keys.add(kernel_key(cfg, n, k, "normal", 1, torch.bfloat16, False))
    for n, k in GROUPED_NK:  # DEEPGEMM_EPILOGUE=direct: stores straight from the accumulators
        cfg = pick_config("fp8", 1024, n, k, num_groups=1, grouping="masked", num_sms=132)
        keys.add(kernel_key(cfg, n, k, "masked", 1, torch.bfloat16, False))
    cfg = pick_config("bf16", 128, 7168, 2048, num_sms=132)
    keys.add(kernel_key(cfg, 7168, 2048, "normal", 1, torch.float32, True))
    # bf16 accumulation into bf16 (DeepGEMM's c.dtype == d.dtype): the staged epilogue reads the bf16 C in place
    for m in (128, 4096):
        for n, k in DENSE_NK:
            cfg = pick_config("bf16", m, n, k, num_sms=132, staged_store=4)
            keys.add(kernel_key(cfg, n, k, "normal", 1, torch.bfloat16, True, c_bf16=True))
    # the MoE row's grouped GEMMs (bench_models: Mixtral-8x7B, 4096 tokens x top-2 on the 9216-row static layout)
    for kind in ("fp8", "bf16"):
        for n, k in ((28672, 4096), (4096, 14336)):
            cfg = pick_config(kind, 9216, n, k, num_groups=8, grouping="contiguous", num_sms=132, tma_store=True)
            keys.add(kernel_key(cfg, n, k, "contiguous", 8, torch.bfloat16, False))
    # grouped on tilehal's producer-fed schedule or not: each key with the -D switches production compiles it with
    return sorted(keys, key=lambda k: (kernel_options(k), k.expression))


CONFIGS = issue_configs()
BATCH = 8  # instantiations per NVRTC program: the front end parses the headers once per batch
# one NVRTC program per batch: a batch's kernels share their -D switches (kernel_options)
BATCHES = [b for opts in sorted({kernel_options(k) for k in CONFIGS})
           for same in [[k for k in CONFIGS if kernel_options(k) == opts]]
           for b in (same[i:i + BATCH] for i in range(0, len(same), BATCH))]


@pytest.mark.parametrize("batch", BATCHES, ids=[f"configs{i * BATCH}-{i * BATCH + len(b) - 1}"
                                                 for i, b in enumerate(BATCHES)])
def test_kernel_configs_compile(batch, h):
    exprs = [k.expression for k in batch]
    mod = tilehal.compile_cuda(kernel_source(), arch="sm_90a", name="deepgemm_compile_check",
                               options=OPTIONS + kernel_options(batch[0]) + ("--ptxas-options=-v",),
                               name_expressions=exprs)
    assert len(mod.cubin) > 1000
    # ptxas falls back to synchronous wgmma (C7514/C7517/C7518) when it cannot prove the
    # accumulators are not touched while in flight: that would undo the overlapped promotion.
    h.check_compiled(mod, exprs, ("serialized", "wait_group is injected"))


def test_issue_configs_are_many_and_distinct():
    assert len(CONFIGS) == len({k.expression for k in CONFIGS}) > 40
    assert sum(len(b) for b in BATCHES) == len(CONFIGS)
    # the contiguous fp8 default (s26 R3: producer-fed schedule + overlapped promotion) is compiled as production does
    assert any(k.tile_info and k.overlap_promotion and k.grouping == "contiguous" for k in CONFIGS)
    staged = [k for k in CONFIGS if k.d_swizzle == 1 and not k.tma_store]
    assert {k.grouping for k in staged} >= {"masked", "normal"} and any(k.has_c for k in staged)
    assert any(k.d_swizzle == 0 and not k.tma_store for k in CONFIGS)  # the direct path too


def test_both_fp8_promotion_paths_are_compiled():
    fp8 = [k for k in CONFIGS if k.fp8]
    overlapped = {k.block_n for k in fp8 if k.overlap_promotion}
    assert {8, 16, 56, 80, 96, 128} <= overlapped and max(overlapped) == 128
    assert any(not k.overlap_promotion and k.block_n == 128 for k in fp8)  # serial twin of the same tile
    assert any(not k.overlap_promotion and k.block_n > 128 for k in fp8)  # too wide for two partial-sum sets
    assert not any(k.overlap_promotion for k in CONFIGS if not k.fp8)


HEADERS_PROBE = r"""
#include <tilehal/tilehal.cuh>
#include <tilehal/mbarrier.cuh>
#include <tilehal/tma.cuh>
#include <tilehal/wgmma.cuh>
using namespace tilehal;
// Touches every helper so that each inline-asm string is assembled by ptxas.
extern "C" __global__ void __launch_bounds__(256, 1) probe(const __grid_constant__ TmaDescriptor desc, float* out) {
  __shared__ __align__(1024) unsigned char tile[64 * 128 + 256 * 128];
  __shared__ u64 bar;
  if (threadIdx.x == 0) { mbarrier_init(&bar, 1); fence_barrier_init(); tma_prefetch_descriptor(&desc); }
  __syncthreads();
  if (threadIdx.x >= 128) { setmaxnreg_dec<40>(); return; }
  setmaxnreg_inc<232>();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar, 64 * 128);
    tma_load_2d(tile, &desc, &bar, 0, 0);
    tma_load_3d(tile, &desc, &bar, 0, 0, 0);
  }
  mbarrier_wait(&bar, 0);
  float acc[128];
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  u64 da = make_smem_desc_k128b(tile), db = make_smem_desc_k128b(tile + 64 * 128);
  wgmma_fence_operands(acc);
  wgmma_fence();
  WgmmaE4M3<256>::mma(acc, da, db, 0);
  WgmmaE4M3<8>::mma(acc, da, db, 1);
  WgmmaBF16<256>::mma(acc, da, db, 1);
  WgmmaBF16<136>::mma(acc, da, db, 1);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operands(acc);
  fence_proxy_async_shared();
  if (threadIdx.x == 0) { tma_store_2d(&desc, tile, 0, 0); tma_store_commit(); tma_store_wait_read<0>(); }
  float s = 0.f;
  for (int i = 0; i < 128; ++i) s += acc[i];
  out[threadIdx.x] = s;
}
extern "C" __global__ void __cluster_dims__(2, 1, 1) probe_cluster(const __grid_constant__ TmaDescriptor desc) {
  __shared__ __align__(1024) unsigned char tile[8 * 128];
  __shared__ u64 bar;
  if (threadIdx.x == 0) {
    mbarrier_init(&bar, 2);
    tma_load_2d_multicast(tile, &desc, &bar, 0, 0, 0x3);
    mbarrier_arrive_cluster(&bar, 1);
  }
}
"""


def test_tilehal_hopper_headers_compile():
    mod = tilehal.compile_cuda(HEADERS_PROBE, arch="sm_90a", name="tilehal_hopper_probe")
    assert len(mod.cubin) > 1000
