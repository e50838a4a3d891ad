"""Helpers around the fine-grained FP8 recipe: casts, scale layouts, SM count, alignment.

Scale factors (sf) are float32. Activations use 1x128 blocks (one scale per token and 128-wide
K block), weights 128x128 blocks. The CUDA kernels read activation scales through TMA, which
wants them MN-major (consecutive tokens adjacent) with a 16-byte aligned stride.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from tilehal import ShapeError

log = logging.getLogger("deepgemm")

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK_K = 128  # K granularity of every scale factor
_M_ALIGNMENT_CONTIGUOUS = 128
_num_sms: int | None = None


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for non-negative integers."""
    return (a + b - 1) // b


def align(x: int, a: int) -> int:
    return ceil_div(x, a) * a


def set_num_sms(num_sms: int) -> None:
    """Limit the persistent kernels to `num_sms` SMs (e.g. to leave SMs to communication kernels)."""
    if not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms: expected a positive int, got {num_sms!r}")
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if num_sms > total:
            raise ValueError(f"num_sms: expected at most {total} (this device's SM count), got {num_sms}")
    global _num_sms
    _num_sms = num_sms


def get_num_sms() -> int:
    """SMs the kernels may use: set_num_sms's value, else the current device's count (132 without a GPU,
    the H200/H800 count, so CPU-side planning matches the common target)."""
    if _num_sms is not None:
        return _num_sms
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132


def get_m_alignment_for_contiguous_layout() -> int:
    """Each expert's rows in the contiguous grouped layout start at a multiple of this."""
    return _M_ALIGNMENT_CONTIGUOUS


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """`x` rounded up so that x * element_size is a multiple of 16 bytes (TMA's stride rule)."""
    return align(x, 16 // element_size)


def _check_2d_or_3d(x: Any, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ShapeError(f"{name}: expected 2 or 3 dimensions, got {x.dim()} (shape {tuple(x.shape)})")


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., M, K] per token and 128-wide K block: returns (x_fp8 [..., M, K], sf [..., M, ceil(K/128)]).

    sf = amax / 448 (amax clamped to 1e-4 so all-zero blocks stay finite); x ~= x_fp8 * sf.
    """
    _check_2d_or_3d(x, "x")
    *lead, m, k = x.shape
    sk = ceil_div(k, BLOCK_K)
    xf = x.float()
    if k % BLOCK_K:
        xf = torch.nn.functional.pad(xf, (0, sk * BLOCK_K - k))
    blocks = xf.view(*lead, m, sk, BLOCK_K)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    q = (blocks * (FP8_MAX / amax)).to(torch.float8_e4m3fn).view(*lead, m, sk * BLOCK_K)[..., :k]
    return q.contiguous(), (amax / FP8_MAX).squeeze(-1).contiguous()


def per_block_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., N, K] per 128x128 block: returns (x_fp8 [..., N, K], sf [..., ceil(N/128), ceil(K/128)])."""
    _check_2d_or_3d(x, "x")
    *lead, n, k = x.shape
    sn, sk = ceil_div(n, BLOCK_K), ceil_div(k, BLOCK_K)
    xf = torch.nn.functional.pad(x.float(), (0, sk * BLOCK_K - k, 0, sn * BLOCK_K - n))
    blocks = xf.view(*lead, sn, BLOCK_K, sk, BLOCK_K)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=1e-4)
    q = (blocks * (FP8_MAX / amax)).to(torch.float8_e4m3fn).view(*lead, sn * BLOCK_K, sk * BLOCK_K)[..., :n, :k]
    return q.contiguous(), (amax / FP8_MAX).view(*lead, sn, sk).contiguous()


def is_mn_major_tma_aligned(sf: torch.Tensor) -> bool:
    """True when sf [..., MN, SK] already has the layout the kernels read (MN-major, aligned stride)."""
    if sf.dim() < 2 or sf.dtype != torch.float32:
        return False
    mn, sk = sf.shape[-2], sf.shape[-1]
    aligned = get_tma_aligned_size(mn, 4)
    if sf.stride(-2) != 1 or (sk > 1 and sf.stride(-1) != aligned):
        return False
    if sf.dim() == 3 and sf.shape[0] > 1 and sf.stride(0) != aligned * sk:
        return False
    return sf.data_ptr() % 16 == 0


def get_mn_major_tma_aligned_tensor(sf: torch.Tensor) -> torch.Tensor:
    """Return sf [..., MN, SK] (same values and shape) stored MN-major with the MN stride padded to 16 bytes.

    This is the layout the CUDA kernels read activation scales in; a tensor already in it is returned as is.
    """
    _check_2d_or_3d(sf, "sf")
    if sf.dtype != torch.float32:
        raise ShapeError(f"sf: expected dtype float32, got {sf.dtype}")
    if is_mn_major_tma_aligned(sf):
        return sf
    squeeze = sf.dim() == 2
    s = sf.unsqueeze(0) if squeeze else sf
    g, mn, sk = s.shape
    aligned = get_tma_aligned_size(mn, 4)
    storage = torch.empty((g, sk, aligned), dtype=torch.float32, device=sf.device)
    storage[:, :, :mn] = s.transpose(1, 2)
    out = storage[:, :, :mn].transpose(1, 2)
    return out[0] if squeeze else out


def transform_sf_into_required_layout(
    sf: torch.Tensor,
    mn: int,
    k: int,
    recipe: tuple[int, int, int] = (1, 128, 128),
    num_groups: int | None = None,
    is_sfa: bool = True,
) -> torch.Tensor:
    """Check a scale tensor against its operand's size and return it in the layout the kernels read.

    sfa (1x128 blocks): [(G,) mn, ceil(k/128)] -> MN-major, TMA-aligned. sfb (128x128 blocks):
    [(G,) ceil(mn/128), ceil(k/128)] -> contiguous. `recipe` is (gran_m, gran_n, gran_k).
    """
    gran_mn = recipe[0] if is_sfa else recipe[1]
    name = "sfa" if is_sfa else "sfb"
    if tuple(recipe) != (1, 128, 128):
        raise ValueError(f"recipe: expected (1, 128, 128), got {tuple(recipe)}")
    expected = (ceil_div(mn, gran_mn), ceil_div(k, recipe[2]))
    if num_groups is not None:
        expected = (num_groups, *expected)
    if not isinstance(sf, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch tensor, got {type(sf).__name__}")
    if tuple(sf.shape) != expected:
        raise ShapeError(f"{name}: expected shape {expected}, got {tuple(sf.shape)}")
    if sf.dtype != torch.float32:
        raise ShapeError(f"{name}: expected dtype float32, got {sf.dtype}")
    if is_sfa:
        return get_mn_major_tma_aligned_tensor(sf)
    return sf.contiguous()
