# requires: cuda
"""A ladder of small-to-decode FP4 cases on the wgmma kernels (bf16 and e4m3 activations), each against the
float64 reference, printing the relative error and, where it is wrong, where: the first bad (token, row)
pairs and the error per token-tile / 16-row slice (a fragment-layout or split-K mistake shows as a pattern).

    python packages/deepgemm/scripts/diag_fp4_wgmma.py [--kind bf16|e4m3|both]
"""

from __future__ import annotations

import argparse
import os

import deepgemm
import torch
from deepgemm import fp4

CASES = [  # (m, n, k): one chunk, two chunks (A double buffer), a cluster split, wide token tiles
    (8, 64, 128), (8, 64, 256), (1, 64, 1024), (16, 128, 2048), (64, 128, 512), (128, 128, 512), (1, 7168, 2048),
    (128, 4096, 7168),
]


def one(m, n, k, fp8, ue8m0=True):
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn((m, k), generator=g).to(torch.bfloat16).cuda()
    w = torch.randn((n, k), generator=g).cuda() * 0.05
    packed, sf = deepgemm.cast_weights_to_fp4(w, gran_k=32, use_ue8m0=ue8m0)
    d = torch.zeros(m, n, device="cuda")
    if fp8:
        a8, sfa = deepgemm.per_token_cast_to_fp8(a)
        deepgemm.fp8_fp4_gemm_nt((a8, sfa), (packed, sf), d)
        ref = fp4.reference(a8, sfa, packed, sf, 32)
    else:
        deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d)
        ref = fp4.reference(a, None, packed, sf, 32)
    torch.cuda.synchronize()
    err = (d.double() - ref.double()).abs()
    rel = float(err.max() / ref.abs().max().clamp_min(1e-30))
    tag = f"{'e4m3' if fp8 else 'bf16'} {'ue8m0' if ue8m0 else 'fp32sf'} m={m} n={n} k={k}"
    print(f"{tag}: rel_err {rel:.2e}", flush=True)
    if rel > 1e-3:
        bad = (err > 1e-3 * ref.abs().max()).nonzero()[:8].tolist()
        print("   first bad (token, row):", bad)
        tt = min(m, 8)
        per = err[: m - m % tt or m].reshape(-1, tt, n)[:, :, : n - n % 16].reshape(-1, tt, n // 16, 16)
        print("   max err per token of tile 0 x 16-row slice 0..7:", per[0].amax(-1)[:, :8].tolist())
        print("   d[0, :8]", d[0, :8].tolist(), "\n   ref[0, :8]", ref[0, :8].tolist())


def clusters() -> None:
    """The driver's resident-cluster count against the GPC model, at the benchmark's plans."""
    from deepgemm import cuda_fp4

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for fp8 in (False, True):
        for m in (1, 16, 64, 128):
            for n, k in ((7168, 2048), (2112, 7168), (4096, 7168)):
                p = cuda_fp4.plan_wgmma(m, n, k, 1, True, False, False, act_fp8=fp8)
                if p.splits > 1:
                    have = cuda_fp4._max_active_clusters(p.key, p.splits, 0)
                    model = cuda_fp4.cluster_capacity(sms, p.key.min_blocks, p.splits)
                    print(f"clusters {'e4m3' if fp8 else 'bf16'} m={m} n={n} k={k}: {p.tiles_all} of {p.splits} CTAs; "
                          f"driver holds {have}, model {model}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("bf16", "e4m3", "both"), default="both")
    args = ap.parse_args()
    os.environ["DEEPGEMM_FP4_KERNEL"] = "wgmma"
    if args.kind != "e4m3":
        clusters()
    for fp8 in (False, True):
        if args.kind != "both" and fp8 != (args.kind == "e4m3"):
            continue
        for m, n, k in CASES:
            one(m, n, k, fp8)
        one(16, 128, 1024, fp8, ue8m0=False)


if __name__ == "__main__":
    main()
