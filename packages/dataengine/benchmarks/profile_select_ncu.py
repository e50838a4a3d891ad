# requires: cuda, kvpool (for the fp8 summaries' rounding); run under Nsight Compute, e.g.
#   ncu --kernel-name regex:"quest|topk" --section SpeedOfLight --section MemoryWorkloadAnalysis \
#       --section Occupancy --section WarpStateStats python profile_select_ncu.py
"""One launch of each kernel of the selection (score on CUDA cores / tensor cores, bf16 / fp8
summaries, fp8 / int4 through the rings; top-k fast / plain; the one-launch selections: chunked bf16 / fp8 / int4 (rings
and register paths); PROFILE_ONLY=new: the chunked ones, int4 scores and the fast top-k) at b8 x 128K, GQA 32/8, d128, 8192 blocks, top 64. Prints only
the shapes: the profile is ncu's."""

from __future__ import annotations

import os

import torch
from tilehal.testing import environ

B, HQ, H, D, BS, TOP = 8, 32, 8, 128, 16, 64
NB = int(os.environ.get("PROFILE_BLOCKS", "8192"))  # blocks per sequence (512: the 8K case)


def select_kernels() -> None:
    from dataengine import cuda_select
    from kvpool.storage import FP8_DTYPE, fp8_round_outward, int4_encode

    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(B * NB, BS, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    kmin, kmax = k.amin(1), k.amax(1)
    del k
    fmin = fp8_round_outward(kmin, up=False).view(FP8_DTYPE)
    fmax = fp8_round_outward(kmax, up=True).view(FP8_DTYPE)
    imin = torch.cat([int4_encode(kmin[s:s + 8192].float(), up=False) for s in range(0, kmin.shape[0], 8192)])
    imax = torch.cat([int4_encode(kmax[s:s + 8192].float(), up=True) for s in range(0, kmax.shape[0], 8192)])
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(B * NB, device="cuda", generator=g).to(torch.int32).reshape(B, NB)
    sl = torch.full((B,), NB * BS, dtype=torch.int32, device="cuda")
    print(f"select: b{B} x {NB} blocks, GQA {HQ}/{H}, d{D}, top {TOP}", flush=True)
    only = os.environ.get("PROFILE_ONLY", "all")  # "new": the chunked kernels and the fast top-k only
    raw = None
    if only == "all":
        for lo, hi in ((kmin, kmax), (fmin, fmax)):
            for v in ("simt", "mma"):
                raw = cuda_select.quest_raw_scores(q, lo, hi, bt, "max", v)
    raw = cuda_select.quest_raw_scores(q, imin, imax, bt, "max", "mma")
    with environ({"DATAENGINE_RING_SCORES": "on"}):  # scores through the rings (quest_select_chunk_kernel)
        for lo, hi in ((fmin, fmax), (imin, imax)):
            cuda_select.quest_raw_scores(q, lo, hi, bt, "max", "mma")
            cuda_select.select_fused(q, lo, hi, bt, TOP, 1, 1, "max", seq_lens=sl, block_size=BS)
    for lo, hi in ((kmin, kmax), (fmin, fmax), (imin, imax)) if only == "all" else ((imin, imax),):
        with environ({"DATAENGINE_RING_SCORES": "off"}):
            cuda_select.select_fused(q, lo, hi, bt, TOP, 1, 1, "max", seq_lens=sl, block_size=BS)
    for tv in ("fast", "plain") if only == "all" else ("fast",):
        cuda_select.topk_rows(raw, TOP, H, 1, 1, seq_lens=sl, block_size=BS, variant=tv)
    torch.cuda.synchronize()


if __name__ == "__main__":
    select_kernels()
