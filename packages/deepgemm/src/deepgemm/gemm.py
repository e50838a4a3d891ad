"""Public GEMM entry points: validate, then run the sm_90a kernel (CUDA tensors) or the reference (CPU).

Naming follows DeepGEMM: the two letters give the storage of A and B. `n` means A is stored [M, K]
(K-major) / B is stored [K, N]; `t` means A is stored [K, M] / B is stored [N, K]. So `nt` (the
fast path) is A [M, K], B [N, K], D = C + A @ B^T. Scale tensors always describe the logical
operands: sfa [M, ceil(K/128)] (1x128 blocks), sfb [ceil(N/128), ceil(K/128)] (128x128 blocks).
"""

from __future__ import annotations

import logging

import torch
from tilehal import ShapeError

from . import reference, validate
from .utils import get_m_alignment_for_contiguous_layout

log = logging.getLogger("deepgemm")

_LAYOUTS = ("nt", "nn", "tn", "tt")


def _logical(a: torch.Tensor, b: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of A as [M, K] and B as [N, K] for a stored layout."""
    return (a.T if layout[0] == "t" else a), (b.T if layout[1] == "n" else b)


def _k_major_for_cuda(x: torch.Tensor, name: str, layout: str) -> torch.Tensor:
    if x.stride(-1) == 1:
        return x
    # The kernels read both operands K-major through TMA; other layouts are copied once.
    log.debug("%s: layout %s stores it MN-major; copying it K-major for the nt kernel", name, layout)
    return x.contiguous()


def _check_dense(a, b, d, c, k_name_a="a", k_name_b="b"):
    m, k = a.shape
    n, kb = b.shape
    validate.size(k_name_b, "K (its reduction size, matching a)", k, kb)
    validate.shape(d, "d", (m, n))
    if c is not None:
        validate.tensor(c, "c", (torch.float32,), 2)
        validate.shape(c, "c", (m, n))
    return m, n, k


def _fp8_gemm(a_sfa, b_sfb, d, c, recipe, layout: str) -> None:
    a, sfa = validate.pair(a_sfa, "a")
    b, sfb = validate.pair(b_sfb, "b")
    validate.recipe(recipe)
    validate.tensor(a, "a", (validate.FP8,), 2)
    validate.tensor(b, "b", (validate.FP8,), 2)
    validate.tensor(d, "d", validate.OUT_DTYPES, 2)
    la, lb = _logical(a, b, layout)
    m, n, k = _check_dense(la, lb, d, c)
    validate.scales(sfa, sfb, m, n, k, None, None)
    device = validate.same_device(a=a, sfa=sfa, b=b, sfb=sfb, d=d, c=c)
    if device.type == "cuda":
        from . import cuda_gemm

        la, lb = _k_major_for_cuda(la, "a", layout), _k_major_for_cuda(lb, "b", layout)
        cuda_gemm.dense(la, sfa, lb, sfb, d, c)
    else:
        d.copy_(reference.fp8_gemm_nt(la, sfa, lb, sfb, c).to(d.dtype))


def _bf16_gemm(a, b, d, c, layout: str) -> None:
    validate.tensor(a, "a", (torch.bfloat16,), 2)
    validate.tensor(b, "b", (torch.bfloat16,), 2)
    validate.tensor(d, "d", validate.OUT_DTYPES, 2)
    la, lb = _logical(a, b, layout)
    _check_dense(la, lb, d, c)
    device = validate.same_device(a=a, b=b, d=d, c=c)
    if device.type == "cuda":
        from . import cuda_gemm

        la, lb = _k_major_for_cuda(la, "a", layout), _k_major_for_cuda(lb, "b", layout)
        cuda_gemm.dense(la, None, lb, None, d, c)
    else:
        d.copy_(reference.bf16_gemm_nt(la, lb, c).to(d.dtype))


def fp8_gemm_nt(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=(1, 128, 128)) -> None:
    """D = C + A @ B^T. a = (a [M, K] e4m3, sfa [M, ceil(K/128)]), b = (b [N, K] e4m3, sfb [ceil(N/128),
    ceil(K/128)]); d bf16/fp32 [M, N] is written; c (fp32 [M, N], may be d itself) is added."""
    _fp8_gemm(a, b, d, c, recipe, "nt")


def fp8_gemm_nn(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=(1, 128, 128)) -> None:
    """fp8_gemm_nt with b stored [K, N]."""
    _fp8_gemm(a, b, d, c, recipe, "nn")


def fp8_gemm_tn(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=(1, 128, 128)) -> None:
    """fp8_gemm_nt with a stored [K, M] and b stored [K, N]."""
    _fp8_gemm(a, b, d, c, recipe, "tn")


def fp8_gemm_tt(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=(1, 128, 128)) -> None:
    """fp8_gemm_nt with a stored [K, M]."""
    _fp8_gemm(a, b, d, c, recipe, "tt")


def bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None) -> None:
    """D = C + A @ B^T with a [M, K], b [N, K] bf16, d bf16/fp32 [M, N], fp32 accumulation."""
    _bf16_gemm(a, b, d, c, "nt")


def bf16_gemm_nn(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None) -> None:
    """bf16_gemm_nt with b stored [K, N]."""
    _bf16_gemm(a, b, d, c, "nn")


def bf16_gemm_tn(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None) -> None:
    """bf16_gemm_nt with a stored [K, M] and b stored [K, N]."""
    _bf16_gemm(a, b, d, c, "tn")


def bf16_gemm_tt(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None = None) -> None:
    """bf16_gemm_nt with a stored [K, M]."""
    _bf16_gemm(a, b, d, c, "tt")


# ----------------------------------------------------------------------------- grouped (MoE)


def _grouped_operands(a, b, d, fp8: bool, a_ndim: int):
    dt = validate.FP8 if fp8 else torch.bfloat16
    validate.tensor(a, "a", (dt,), a_ndim)
    validate.tensor(b, "b", (dt,), 3)
    validate.tensor(d, "d", validate.OUT_DTYPES, a_ndim)
    g, n, k = b.shape
    validate.size("a", "K (matching b [G, N, K])", k, a.shape[-1])
    return g, n, k


def _contiguous(a, sfa, b, sfb, d, m_indices, fp8: bool) -> None:
    g, n, k = _grouped_operands(a, b, d, fp8, 2)
    m = a.shape[0]
    validate.shape(d, "d", (m, n))
    validate.tensor(m_indices, "m_indices", (torch.int32,), 1)
    validate.shape(m_indices, "m_indices", (m,))
    align = get_m_alignment_for_contiguous_layout()
    if m % align:
        raise ShapeError(f"a: expected M_sum to be a multiple of {align} (the contiguous-layout alignment), got {m}")
    if fp8:
        validate.scales(sfa, sfb, m, n, k, None, g)
    device = validate.same_device(a=a, sfa=sfa, b=b, sfb=sfb, d=d, m_indices=m_indices)
    if device.type == "cuda":
        from . import cuda_gemm

        cuda_gemm.grouped_contiguous(a, sfa, b, sfb, d, m_indices)
    else:
        reference.grouped_contiguous(a, b, m_indices, d, sfa, sfb)


def _masked(a, sfa, b, sfb, d, masked_m, expected_m, fp8: bool) -> None:
    g, n, k = _grouped_operands(a, b, d, fp8, 3)
    validate.size("a", "G (groups, matching b)", g, a.shape[0])
    m_max = a.shape[1]
    validate.shape(d, "d", (g, m_max, n))
    validate.tensor(masked_m, "masked_m", (torch.int32,), 1)
    validate.shape(masked_m, "masked_m", (g,))
    if not isinstance(expected_m, int) or expected_m < 1:
        raise ValueError(f"expected_m: expected a positive int (typical rows per group), got {expected_m!r}")
    if fp8:
        validate.scales(sfa, sfb, m_max, n, k, g, g)
    device = validate.same_device(a=a, sfa=sfa, b=b, sfb=sfb, d=d, masked_m=masked_m)
    if device.type == "cuda":
        from . import cuda_gemm

        cuda_gemm.grouped_masked(a, sfa, b, sfb, d, masked_m, expected_m)
    else:
        reference.grouped_masked(a, b, masked_m, d, sfa, sfb)


def m_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor) -> None:
    """Per-expert GEMM over rows grouped contiguously: d[r] = A[r] @ B[m_indices[r]]^T.

    a = (a [M_sum, K] e4m3, sfa [M_sum, ceil(K/128)]), b = (b [G, N, K] e4m3, sfb [G, ceil(N/128),
    ceil(K/128)]), d [M_sum, N], m_indices int32 [M_sum] (-1 marks padding rows; their output is
    unspecified). Each expert's rows start at a multiple of get_m_alignment_for_contiguous_layout().
    """
    a_, sfa = validate.pair(a, "a")
    b_, sfb = validate.pair(b, "b")
    _contiguous(a_, sfa, b_, sfb, d, m_indices, True)


def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
                                      m_indices: torch.Tensor) -> None:
    """bf16 twin of m_grouped_fp8_gemm_nt_contiguous: a [M_sum, K], b [G, N, K] bf16."""
    _contiguous(a, None, b, None, d, m_indices, False)


def m_grouped_fp8_gemm_nt_masked(a, b, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
    """Per-group GEMM on padded batches: d[g, :masked_m[g]] = A[g, :masked_m[g]] @ B[g]^T.

    a = (a [G, M_max, K] e4m3, sfa [G, M_max, ceil(K/128)]), b = (b [G, N, K], sfb [G, ceil(N/128),
    ceil(K/128)]), d [G, M_max, N]; masked_m int32 [G] stays on the device (no host sync, CUDA-graph
    safe); expected_m is the typical masked_m, used only to pick block sizes. Rows past masked_m[g]
    are not written.
    """
    a_, sfa = validate.pair(a, "a")
    b_, sfb = validate.pair(b, "b")
    _masked(a_, sfa, b_, sfb, d, masked_m, expected_m, True)


def m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, masked_m: torch.Tensor,
                                  expected_m: int) -> None:
    """bf16 twin of m_grouped_fp8_gemm_nt_masked: a [G, M_max, K], b [G, N, K] bf16."""
    _masked(a, None, b, None, d, masked_m, expected_m, False)


# ----------------------------------------------------------------------------- BLAS-style


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
) -> torch.Tensor:
    """BLAS-style alpha * op(a) @ op(b) + beta * c, returned as a new tensor of a's dtype.

    op(x) is x or x^T. bf16 inputs run through bf16_gemm_* (fp32 accumulation; the CUDA kernel on
    GPUs); float32/float64 inputs use torch.matmul in that precision.
    """
    validate.tensor(a, "a", (torch.bfloat16, torch.float32, torch.float64), 2)
    validate.tensor(b, "b", (a.dtype,), 2)
    m, k = (a.shape[1], a.shape[0]) if trans_a else tuple(a.shape)
    kb, n = (b.shape[1], b.shape[0]) if trans_b else tuple(b.shape)
    validate.size("b", "K (rows of op(b), matching op(a)'s columns)", k, kb)
    if beta != 0.0:
        if c is None:
            raise ValueError("c: expected a tensor when beta != 0, got None")
        validate.tensor(c, "c", (a.dtype, torch.float32), 2)
        validate.shape(c, "c", (m, n))
    validate.same_device(a=a, b=b, c=c)
    if a.dtype == torch.bfloat16:
        acc = torch.empty((m, n), dtype=torch.float32, device=a.device)
        # BLAS op(b) is [K, N]; our naming stores B as [N, K] for "t" -> trans_b=False is layout "n".
        layout = ("t" if trans_a else "n") + ("t" if trans_b else "n")
        _bf16_gemm(a, b, acc, None, layout)
    else:
        acc = (a.T if trans_a else a) @ (b.T if trans_b else b)
    if alpha != 1.0:
        acc = acc * alpha
    if beta != 0.0:
        acc = acc + beta * c.to(acc.dtype)
    return acc.to(a.dtype)
