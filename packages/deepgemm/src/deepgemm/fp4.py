"""FP4 (e2m1) weights: packed two per byte with per-row 1 x 32 (or 1 x 128) fp32 block scales.

Format (DeepGEMM's FP4 operand): `b` int8 (or uint8) [(G,) N, K/2], code of k = 2j in the low nibble of
byte j, code of 2j + 1 in the high nibble; a code is sign (bit 3) and an e2m1 magnitude index (bits 0-2)
into {0, 0.5, 1, 1.5, 2, 3, 4, 6}. `sfb` float32 [(G,) N, K/gran_k] (gran_k 32 or 128), or packed UE8M0
int32 [(G,) N, ceil(K/gran_k/4)]. The weight is w[n, k] = e2m1(code[n, k]) * sfb[n, k // gran_k].

Activations are fp8 (e4m3 with 1 x 128 scales, the fp8 recipe's) or bf16. The result is

    D = C + sum over 32-wide K groups g of  sfb[n, g] * (sa[m, g]) * sum_{k in g} a'[m, k] * e2m1[n, k]

with a' the e4m3 (or bf16) value and sa = sfa[m, k // 128] (1 for bf16): products exact, sums in
fp32. `reference` computes the same value in float64, so kernel and reference differ only by fp32
rounding. Hopper has no FP4 tensor cores: the sm_90 kernel (kernels/fp4_gemm_sm90.cuh) decodes the
codes in registers and runs mma.sync; its point is the weight bytes at decode shapes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from tilehal import ShapeError

from . import validate
from .utils import ceil_div, per_token_cast_to_fp4

log = logging.getLogger("deepgemm")

FP4_DTYPES = (torch.int8, torch.uint8)
FP4_GRANS = (32, 128)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def is_fp4_pair(x: Any) -> bool:
    """Whether an operand (tensor, scales) pair holds packed FP4 data."""
    return (isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], torch.Tensor)
            and x[0].dtype in FP4_DTYPES)


def cast_weights_to_fp4(w: torch.Tensor, gran_k: int = 32, use_ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights [(G,) N, K] to (packed int8 [(G,) N, K/2], sfb float32 [(G,) N, K/gran_k]).

    Each 1 x gran_k block gets sf = amax / 6 (rounded up to a power of two with `use_ue8m0`, the default:
    then every dequantized weight e2m1 * sf is exact in bf16 too) and its codes are the nearest e2m1
    values of w / sf (deepgemm.per_token_cast_to_fp4, DeepGEMM's cast)."""
    if not isinstance(w, torch.Tensor) or w.dim() not in (2, 3):
        raise ShapeError(f"w: expected a 2-D [N, K] or 3-D [G, N, K] tensor, got "
                         f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
    if gran_k not in FP4_GRANS:
        raise ValueError(f"gran_k: expected 32 or 128, got {gran_k!r}")
    if w.shape[-1] % gran_k:
        raise ShapeError(f"w: expected K to be a multiple of gran_k = {gran_k}, got K = {w.shape[-1]}")
    if w.dim() == 2:
        return per_token_cast_to_fp4(w, use_ue8m0=use_ue8m0, gran_k=gran_k)
    parts = [per_token_cast_to_fp4(w[i], use_ue8m0=use_ue8m0, gran_k=gran_k) for i in range(w.shape[0])]
    return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., K/2] -> float32 e2m1 values [..., K] (no scales)."""
    u = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([u & 0xF, u >> 4], dim=-1).flatten(-2)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    mag = table[codes & 7]
    return torch.where((codes & 8) != 0, -mag, mag)


def _weights64(b: torch.Tensor, sfb: torch.Tensor, gran_k: int) -> torch.Tensor:
    vals = decode_e2m1(b).double()
    return vals * sfb.double().repeat_interleave(gran_k, dim=-1)[..., : vals.shape[-1]]


def reference(a: torch.Tensor, sfa: torch.Tensor | None, b: torch.Tensor, sfb: torch.Tensor, gran_k: int,
              c: torch.Tensor | None = None) -> torch.Tensor:
    """float64 D = C + A @ W^T for a [M, K] (e4m3 with sfa [M, K/128], or bf16 with sfa None), b packed
    [N, K/2], sfb float32 [N, K/gran_k]."""
    af = a.double()
    if sfa is not None:
        af = af * sfa.double().repeat_interleave(128, dim=-1)[..., : a.shape[-1]]
    out = af @ _weights64(b, sfb, gran_k).transpose(-1, -2)
    if c is not None:
        out = out + c.double()
    return out


# ----------------------------------------------------------------------------- argument checks


def _gran_k(recipe, recipe_a, recipe_b, k: int, sfb: torch.Tensor, fp8_a: bool) -> int:
    """gran_k of the weight scales: from recipe_b (1, 32|128) or recipe (1, 1, 32|128), else from sfb's shape."""
    gk = None
    if recipe is not None:
        if recipe_a is not None or recipe_b is not None:
            raise ValueError(f"recipe: expected either recipe or the recipe_a/recipe_b pair, got recipe={recipe!r} "
                             f"with recipe_a={recipe_a!r}, recipe_b={recipe_b!r}")
        r = validate._int_tuple(recipe, "recipe", 3)
        if r[:2] != (1, 1):
            raise ValueError(f"recipe: FP4 weights take per-row scales, expected (1, 1, gran_k), got {r}")
        gk = r[2]
    elif recipe_b is not None:
        rb = validate._int_tuple(recipe_b, "recipe_b", 2)
        if rb[0] != 1:
            raise ValueError(f"recipe_b: FP4 weights take per-row scales, expected (1, gran_k), got {rb}")
        gk = rb[1]
        if recipe_a is not None:
            ra = validate._int_tuple(recipe_a, "recipe_a", 2)
            if fp8_a and ra != (1, 128):
                raise validate.UnsupportedError(f"recipe_a: fp8 activations with FP4 weights take (1, 128), got {ra}")
    elif recipe_a is not None:
        raise ValueError(f"recipe_a/recipe_b: expected both or neither, got recipe_a={recipe_a!r}, recipe_b=None")
    if gk is None:  # from the scales' shape
        cols = sfb.shape[-1] * (4 if sfb.dtype == torch.int32 else 1)
        gk = next((g for g in FP4_GRANS if ceil_div(k, g) == cols or ceil_div(ceil_div(k, g), 4) * 4 == cols), None)
        if gk is None:
            raise ShapeError(f"sfb: expected [N, K/32] or [N, K/128] scales for K = {k}, got shape {tuple(sfb.shape)}")
    if gk not in FP4_GRANS:
        raise validate.UnsupportedError(f"recipe_b: FP4 weight scales of 1 x 32 or 1 x 128, got gran_k = {gk}")
    return gk


def _fp4_weights(b_pair, k: int, n_dims: int, groups: int | None, recipe, recipe_a, recipe_b, fp8_a: bool):
    b, sfb = validate.pair(b_pair, "b")
    validate.tensor(b, "b", FP4_DTYPES, n_dims)
    n = b.shape[-2]
    validate.size("b", "K/2 (two e2m1 codes per byte)", k // 2 if k % 2 == 0 else -1, b.shape[-1])
    if not isinstance(sfb, torch.Tensor):
        raise ShapeError(f"sfb: expected a torch tensor, got {type(sfb).__name__}")
    gran = _gran_k(recipe, recipe_a, recipe_b, k, sfb, fp8_a)
    sfb = validate.sf(sfb, "sfb", n, k, 1, gran, groups)
    return b, sfb, n, gran


def _activations(a_in, fp8: bool, n_dims: int):
    if fp8:
        a, sfa = validate.pair(a_in, "a")
        if isinstance(a, torch.Tensor) and a.dtype in FP4_DTYPES:
            raise validate.UnsupportedError("a: FP4 activations (DeepGEMM's SM100 fp4 x fp4) are not supported on "
                                            "sm_90; pass e4m3 activations with 1 x 128 scales, or bf16")
        validate.tensor(a, "a", (validate.FP8,), n_dims)
        return a, sfa
    validate.tensor(a_in, "a", (torch.bfloat16,), n_dims)
    return a_in, None


def _check_k(k: int) -> None:
    if k % 128:
        raise ShapeError(f"a: expected K to be a multiple of 128 for FP4 weights, got K = {k}")


# ----------------------------------------------------------------------------- dense


def gemm_nt(a_in, b_pair, d: torch.Tensor, c: torch.Tensor | None = None, recipe=None, recipe_a=None, recipe_b=None,
            fp8: bool = True) -> None:
    """d = c + a @ W^T with FP4 weights W: the fp8_fp4_gemm_nt / bf16_fp4_gemm_nt body."""
    a, sfa = _activations(a_in, fp8, 2)
    m, k = a.shape
    _check_k(k)
    b, sfb, n, gran = _fp4_weights(b_pair, k, 2, None, recipe, recipe_a, recipe_b, fp8)
    validate.tensor(d, "d", validate.OUT_DTYPES, 2)
    validate.shape(d, "d", (m, n))
    if c is not None:
        validate.tensor(c, "c", (d.dtype,), 2)
        validate.shape(c, "c", (m, n))
    if fp8:
        sfa = validate.sf(sfa, "sfa", m, k, 1, 128, None)
    device = validate.same_device(a=a, sfa=sfa, b=b, sfb=sfb, d=d, c=c)
    if device.type == "cuda":
        from . import cuda_fp4

        cuda_fp4.dense(a, sfa, b, sfb, gran, d, c)
    else:
        d.copy_(reference(a, sfa, b, sfb, gran, c).to(d.dtype))


def fp8_fp4_gemm_nt(a, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe=None, recipe_a=None,
                    recipe_b=None) -> None:
    """D = C + A @ W^T: a = (e4m3 [M, K], sfa [M, K/128]), b = (packed e2m1 int8 [N, K/2], sfb [N, K/32] or
    [N, K/128] fp32, or packed UE8M0 int32), d bf16/fp32 [M, N], c of d's dtype. recipe_a=(1, 128),
    recipe_b=(1, 32) as in DeepGEMM (or recipe=(1, 1, gran_k); neither: gran_k from sfb's shape). K % 128 == 0."""
    gemm_nt(a, b, d, c, recipe, recipe_a, recipe_b, fp8=True)


def bf16_fp4_gemm_nt(a: torch.Tensor, b, d: torch.Tensor, c: torch.Tensor | None = None, recipe_b=None) -> None:
    """D = C + A @ W^T with bf16 activations a [M, K] and FP4 weights b = (packed [N, K/2], sfb)."""
    gemm_nt(a, b, d, c, None, None, recipe_b, fp8=False)


# ----------------------------------------------------------------------------- grouped (MoE, masked)


def grouped_masked(a_in, b_pair, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int, recipe=None,
                   recipe_a=None, recipe_b=None, fp8: bool = True) -> None:
    """d[g, :masked_m[g]] = a[g, :masked_m[g]] @ W_g^T with FP4 expert weights b = (packed [G, N, K/2], sfb
    [G, N, K/gran_k]); a [G, M_max, K] (e4m3 with sfa [G, M_max, K/128], or bf16); rows past masked_m[g]
    are not written; masked_m stays on the device (CUDA-graph safe)."""
    a, sfa = _activations(a_in, fp8, 3)
    g, m_max, k = a.shape
    _check_k(k)
    b, sfb, n, gran = _fp4_weights(b_pair, k, 3, g, recipe, recipe_a, recipe_b, fp8)
    validate.size("b", "G (groups, matching a)", g, b.shape[0])
    validate.tensor(d, "d", validate.OUT_DTYPES, 3)
    validate.shape(d, "d", (g, m_max, n))
    validate.tensor(masked_m, "masked_m", (torch.int32,), 1)
    validate.shape(masked_m, "masked_m", (g,))
    if not isinstance(expected_m, int) or expected_m < 1:
        raise ValueError(f"expected_m: expected a positive int (typical rows per group), got {expected_m!r}")
    if fp8:
        sfa = validate.sf(sfa, "sfa", m_max, k, 1, 128, g)
    device = validate.same_device(a=a, sfa=sfa, b=b, sfb=sfb, d=d, masked_m=masked_m)
    if device.type == "cuda":
        from . import cuda_fp4

        cuda_fp4.grouped_masked(a, sfa, b, sfb, gran, d, masked_m, expected_m)
        return
    rows = masked_m.clamp(0, m_max).tolist()
    for i in range(g):
        r = rows[i]
        if r:
            ref = reference(a[i, :r], None if sfa is None else sfa[i, :r], b[i], sfb[i], gran)
            d[i, :r] = ref.to(d.dtype)


def m_grouped_bf16_fp4_gemm_nt_masked(a: torch.Tensor, b, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int,
                                      recipe_b=None) -> None:
    """bf16 activations a [G, M_max, K] x FP4 expert weights (packed [G, N, K/2], sfb): grouped_masked."""
    grouped_masked(a, b, d, masked_m, expected_m, None, None, recipe_b, fp8=False)

