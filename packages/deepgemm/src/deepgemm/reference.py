"""The exact semantics of every GEMM, in plain torch (any device; used on the CPU).

FP8: each operand is dequantized only through its scales, and partial products are summed in
fp32 one 128-wide K block at a time, then promoted: acc += partial * (sfa[m, kb] * sfb[n/128, kb]).
That is what the CUDA kernels do (wgmma accumulates one K block, the math warps promote it), so
the reference and the kernels differ only by fp32 summation order inside a block.
Operands here are already in logical orientation: a [M, K], b [N, K]; D = C + A @ B^T.
"""

from __future__ import annotations

import torch

from .utils import BLOCK_K, ceil_div


def fp8_gemm_nt(
    a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, c: torch.Tensor | None
) -> torch.Tensor:
    """fp32 result of C + A @ B^T with 1x128 (sfa [M, SK]) and 128x128 (sfb [SN, SK]) scales."""
    m, k = a.shape
    n = b.shape[0]
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    af, bf = a.float(), b.float()
    sfa, sfb = sfa.float(), sfb.float()
    for kb in range(ceil_div(k, BLOCK_K)):
        ks = slice(kb * BLOCK_K, min(k, (kb + 1) * BLOCK_K))
        partial = af[:, ks] @ bf[:, ks].T
        sb = sfb[:, kb].repeat_interleave(BLOCK_K)[:n]
        acc += partial * (sfa[:, kb : kb + 1] * sb[None, :])
    if c is not None:
        acc = acc + c.float()
    return acc


def bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """fp32 result of C + A @ B^T, products of bf16 inputs summed in fp32."""
    acc = a.float() @ b.float().T
    if c is not None:
        acc = acc + c.float()
    return acc


def grouped_contiguous(
    a: torch.Tensor,
    b: torch.Tensor,
    m_indices: torch.Tensor,
    d: torch.Tensor,
    sfa: torch.Tensor | None = None,
    sfb: torch.Tensor | None = None,
) -> None:
    """d[rows of group g] = A[rows] @ B[g]^T for every g; rows with a negative index are left as they are."""
    idx = m_indices.to(torch.int64).cpu()
    for g in range(b.shape[0]):
        rows = torch.nonzero(idx == g).flatten().to(a.device)
        if rows.numel() == 0:
            continue
        if sfa is None:
            out = bf16_gemm_nt(a[rows], b[g], None)
        else:
            out = fp8_gemm_nt(a[rows], sfa[rows], b[g], sfb[g], None)
        d[rows] = out.to(d.dtype)


def grouped_masked(
    a: torch.Tensor,
    b: torch.Tensor,
    masked_m: torch.Tensor,
    d: torch.Tensor,
    sfa: torch.Tensor | None = None,
    sfb: torch.Tensor | None = None,
) -> None:
    """d[g, :masked_m[g]] = A[g, :masked_m[g]] @ B[g]^T; rows past masked_m[g] are left as they are."""
    counts = masked_m.to(torch.int64).cpu().tolist()
    for g, rows in enumerate(counts):
        rows = max(0, min(int(rows), a.shape[1]))
        if rows == 0:
            continue
        if sfa is None:
            out = bf16_gemm_nt(a[g, :rows], b[g], None)
        else:
            out = fp8_gemm_nt(a[g, :rows], sfa[g, :rows], b[g], sfb[g], None)
        d[g, :rows] = out.to(d.dtype)
