"""The exact semantics of every GEMM, in plain torch (any device; used on the CPU).

FP8: each operand is dequantized only through its scales, and partial products are summed in
fp32 one 128-wide K block at a time, then promoted: acc += partial * (sfa[m, kb] * sfb[n/128, kb]).
That is what the CUDA kernels do (wgmma accumulates one K block, the math warps promote it), so
the reference and the kernels differ only by fp32 summation order inside a block.
Operands here are already in logical orientation: a [M, K], b [N, K]; D = C + A @ B^T.
"""

from __future__ import annotations

import torch

from .utils import BLOCK_K, CONTIGUOUS_BLOCK_M, ceil_div


def fp8_gemm_nt(
    a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, c: torch.Tensor | None,
    gran_k: int = BLOCK_K, gran_n: int = BLOCK_K,
) -> torch.Tensor:
    """fp32 result of C + A @ B^T with 1 x gran_k activation scales (sfa [M, SK]) and gran_n x gran_k weight
    scales (sfb [ceil(N/gran_n), SK]; gran_n = 1 is the 1D1D weight-gradient recipe, one scale per row of B)."""
    m, k = a.shape
    n = b.shape[0]
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    af, bf = a.float(), b.float()
    sfa, sfb = sfa.float(), sfb.float()
    for kb in range(ceil_div(k, gran_k)):
        ks = slice(kb * gran_k, min(k, (kb + 1) * gran_k))
        partial = af[:, ks] @ bf[:, ks].T
        sb = sfb[:, kb] if gran_n == 1 else sfb[:, kb].repeat_interleave(gran_n)[:n]
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


def effective_groups(m_indices: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The group each row is computed with, as the sm_90a contiguous kernel does (int64 [M], -1: not written).

    The kernel works in CONTIGUOUS_BLOCK_M-row blocks and takes a block's expert from its first row: a
    block whose first row is padding (-1, or an index outside [0, G)) is skipped, its rows left as they
    are; in any other block a padding row is computed with that block's expert (so zero A rows give zero
    output rows, what DeepGEMM's kernels write too). Valid rows always use their own index.
    """
    idx = m_indices.to(torch.int64).cpu()
    idx = torch.where((idx >= 0) & (idx < num_groups), idx, torch.full_like(idx, -1))
    first = idx[(torch.arange(idx.numel()) // CONTIGUOUS_BLOCK_M) * CONTIGUOUS_BLOCK_M]
    return torch.where(idx >= 0, idx, first)


def grouped_contiguous(
    a: torch.Tensor,
    b: torch.Tensor,
    m_indices: torch.Tensor,
    d: torch.Tensor,
    sfa: torch.Tensor | None = None,
    sfb: torch.Tensor | None = None,
    gran_k: int = BLOCK_K,
    gran_n: int = BLOCK_K,
) -> None:
    """d[rows of group g] = A[rows] @ B[g]^T for every g, rows assigned by effective_groups (padding as the kernel)."""
    eff = effective_groups(m_indices, b.shape[0])
    for g in range(b.shape[0]):
        rows = torch.nonzero(eff == g).flatten().to(a.device)
        if rows.numel() == 0:
            continue
        if sfa is None:
            out = bf16_gemm_nt(a[rows], b[g], None)
        else:
            out = fp8_gemm_nt(a[rows], sfa[rows], b[g], sfb[g], None, gran_k, gran_n)
        d[rows] = out.to(d.dtype)


def k_grouped_1d1d(
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    c: torch.Tensor, d: torch.Tensor, gran_k: int = BLOCK_K,
) -> None:
    """d[g] = c[g] + A_g @ B_g^T for (A_g [M, K_g], sfa_g [M, SK_g], B_g [N, K_g], sfb_g [N, SK_g]) per group
    (1 x gran_k scales on both operands: the MoE weight-gradient GEMM). K_g = 0 gives d[g] = c[g]."""
    out = torch.empty_like(d, dtype=torch.float32)
    for g, (a, sfa, b, sfb) in enumerate(groups):
        out[g] = fp8_gemm_nt(a, sfa, b, sfb, c[g], gran_k, 1) if a.shape[1] else c[g].float()
    d.copy_(out.to(d.dtype))


def k_grouped_bf16(groups: list[tuple[torch.Tensor, torch.Tensor]], c: torch.Tensor, d: torch.Tensor) -> None:
    """d[g] = c[g] + A_g @ B_g^T for (A_g [M, K_g], B_g [N, K_g]) bf16 per group, fp32 accumulation."""
    out = torch.empty_like(d, dtype=torch.float32)
    for g, (a, b) in enumerate(groups):
        out[g] = bf16_gemm_nt(a, b, c[g])
    d.copy_(out.to(d.dtype))


def grouped_masked(
    a: torch.Tensor,
    b: torch.Tensor,
    masked_m: torch.Tensor,
    d: torch.Tensor,
    sfa: torch.Tensor | None = None,
    sfb: torch.Tensor | None = None,
    gran_k: int = BLOCK_K,
    gran_n: int = BLOCK_K,
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
            out = fp8_gemm_nt(a[g, :rows], sfa[g, :rows], b[g], sfb[g], None, gran_k, gran_n)
        d[g, :rows] = out.to(d.dtype)
