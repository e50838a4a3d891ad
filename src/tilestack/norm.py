"""RMSNorm in one kernel: transformers' `*RMSNorm` modules (Llama, Mistral, Qwen2/3, Mixtral, Qwen-MoE,
DeepSeek-V3) computed with their exact formula,

    y = weight * bf16(x_fp32 * rsqrt(mean(x_fp32 ** 2) + eps))

which eager PyTorch runs as ~7 kernels over fp32 copies of the activations (to, pow, mean, add, rsqrt,
mul, to, mul): about 9x the bytes of one pass and 7 launches. The CUDA kernel (NVRTC through tilehal, sm_90a)
reads each row once into registers (one CTA per row), reduces the sum of squares in fp32, and writes the row
once; the roundings are the module's (the product rounded to bf16, then times the weight rounded to bf16).
Only the order of the fp32 sum differs from torch's mean, so a row's scale may differ in its last bit.

`FusedRMSNorm` keeps the original module's `weight` parameter (state_dict keys unchanged). It runs the
kernel for CUDA bf16 inputs and bf16 weights (rows of <= MAX_HIDDEN elements, last dim contiguous); anything
else, and everything under torch.compile (inductor fuses the torch formula itself), runs the torch formula,
the reason logged at DEBUG once.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import tilehal
import torch

log = logging.getLogger("tilestack.norm")

# transformers 5 classes whose forward is exactly the formula above (checked against each class in tests).
RMSNORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MixtralRMSNorm",
                             "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm", "DeepseekV3RMSNorm"})

THREADS = 256
VEC = 8                      # bf16 elements per 16-byte load
MAX_CHUNKS = 4               # 16-byte chunks a thread keeps in registers
MAX_HIDDEN = THREADS * VEC * MAX_CHUNKS

KERNEL_SOURCE = r"""
#include <tilehal/tilehal.cuh>

namespace tilestack {

// One CTA per row. CHUNKS 16-byte chunks per thread cover the row (h <= THREADS * 8 * CHUNKS); VEC: 16-byte
// loads and stores (h % 8 == 0, row strides % 8 == 0, 16-byte aligned bases), else element by element.
// FP8 (VEC, h % 128 == 0): the bf16 output is also cast to e4m3 per token and 128 columns, exactly as
// deepgemm's per_token_cast of that output (q [rows, h] contiguous, sf[row * sf_rs + kb * sf_cs]).
template <int THREADS, int CHUNKS, bool VEC, bool FP8>
__global__ void __launch_bounds__(THREADS) rms_norm_bf16(const __nv_bfloat16* __restrict__ x,
                                                         const __nv_bfloat16* __restrict__ w,
                                                         __nv_bfloat16* __restrict__ y, int rows, int h,
                                                         long long ldx, long long ldy, float eps,
                                                         unsigned char* __restrict__ q, float* __restrict__ sf,
                                                         long long sf_rs, long long sf_cs) {
  static_assert(!FP8 || VEC, "the fp8 output needs the 16-byte path");
  __shared__ float scratch[THREADS / 32];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const __nv_bfloat16* xr = x + static_cast<long long>(row) * ldx;
  __nv_bfloat16* yr = y + static_cast<long long>(row) * ldy;
  float v[CHUNKS][8];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    tilehal::load8<__nv_bfloat16, VEC>(xr, (c * THREADS + threadIdx.x) * 8, h, v[c]);
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += v[c][i] * v[c][i];
  }
  ss = tilehal::block_sum(ss, scratch);
  const float r = rsqrtf(ss / static_cast<float>(h) + eps);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int col = (c * THREADS + threadIdx.x) * 8;
    if (!FP8 && col >= h) continue;  // (FP8: every lane reaches the scale's shuffles; past h all values are 0)
    float wv[8], o[8];
    tilehal::load8<__nv_bfloat16, VEC>(w, col, h, wv);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = __bfloat162float(__float2bfloat16_rn(v[c][i] * r)) * wv[i];
    tilehal::store8<__nv_bfloat16, VEC>(yr, col, h, o);
    if constexpr (FP8) {
      float yb[8];   // the bf16 output as the cast would read it
#pragma unroll
      for (int i = 0; i < 8; ++i) yb[i] = __bfloat162float(__float2bfloat16_rn(o[i]));
      const float s = tilehal::scale_of(tilehal::group_amax<16>(tilehal::abs_max8(yb)), false);
      if (col < h) {
        tilehal::store8(q + static_cast<long long>(row) * h, col, h, yb, 1.0f / s, true);
        if (threadIdx.x % 16 == 0) sf[row * sf_rs + static_cast<long long>(col / 128) * sf_cs] = s;
      }
    }
  }
}

}  // namespace tilestack
"""


def kernel_expression(chunks: int, vec: bool, fp8: bool = False) -> str:
    b = {True: "true", False: "false"}
    return f"tilestack::rms_norm_bf16<{THREADS}, {chunks}, {b[vec]}, {b[fp8]}>"


def all_expressions() -> list[str]:
    return [kernel_expression(c, v, f) for c in range(1, MAX_CHUNKS + 1) for v, f in ((True, False), (False, False),
                                                                                      (True, True))]


def compile_module(expressions: tuple[str, ...] | None = None):
    """NVRTC module (sm_90a; cached on disk by content, no GPU needed)."""
    return tilehal.compile_cuda(KERNEL_SOURCE, arch="sm_90a", name="tilestack_rms_norm", options=("-std=c++17",),
                                name_expressions=list(expressions or all_expressions()))


@functools.lru_cache(maxsize=16)
def _kernel(expr: str):
    return compile_module((expr,)).get_kernel(expr)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm forward, op for op."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def why_not_fused(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernel does not take (x, weight), or None."""
    if not x.is_cuda:
        return f"input on {x.device} (the kernel is CUDA)"
    if x.dtype is not torch.bfloat16 or weight.dtype is not torch.bfloat16:
        return f"dtypes {x.dtype} / weight {weight.dtype} (the kernel takes bf16 / bf16)"
    if weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        return f"shapes {tuple(x.shape)} / weight {tuple(weight.shape)}"
    if x.shape[-1] > MAX_HIDDEN or x.shape[-1] == 0:
        return f"hidden size {x.shape[-1]} (the kernel keeps rows of 1..{MAX_HIDDEN} in registers)"
    if x.stride(-1) != 1 or not weight.is_contiguous():
        return "non-unit stride along the normalized dimension"
    if x.numel() >= 2**31:
        return "more than 2^31 elements"
    if x.device != weight.device:
        return f"input on {x.device}, weight on {weight.device}"
    return None


_PLANS: dict[tuple, tuple] = {}

# The last fp8 output of a FusedRMSNorm(emit_fp8=True): (the bf16 output [rows, h], kept alive so its address
# names it, its signature, (q, sf)). An fp8 GemmLinear whose input is that output (same storage, shape, strides
# and version) takes (q, sf) instead of casting it again (precast_fp8).
_PRECAST: list = [None]


def _signature(x2: torch.Tensor) -> tuple:
    return (x2.data_ptr(), x2.shape, x2.stride(), x2._version, x2.dtype, x2.device)


def precast_fp8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, sf) as deepgemm.per_token_cast_to_fp8(x2, tma_aligned_sf=True) would return them, where x2 is the
    last FusedRMSNorm(emit_fp8=True) output unchanged since (that kernel cast it already), else None."""
    hit = _PRECAST[0]
    if hit is not None and hit[1] == _signature(x2):
        return hit[2]
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of x [..., H] with weight [H]: one kernel where `why_not_fused` is None, else
    the torch formula (rms_norm_reference)."""
    why = why_not_fused(x, weight)
    if why is not None:
        log.debug("rms_norm: torch ops (%s)", why)
        return rms_norm_reference(x, weight, eps)
    return _rms_norm_cuda(x, weight, eps)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(rms_norm(x, weight, eps), its per-token fp8 cast (q [rows, H] e4m3, sf [rows, H / 128] fp32, MN-major
    and TMA-aligned: what deepgemm.per_token_cast_to_fp8(y2, tma_aligned_sf=True) returns for the 2-D output
    y2, bit for bit)) from one kernel, or (the output, None) where the kernel's fp8 mode does not apply
    (`why_not_fp8`)."""
    why = why_not_fused(x, weight) or why_not_fp8(x, weight)
    if why is not None:
        log.debug("rms_norm_fp8: no fused cast (%s)", why)
        return rms_norm(x, weight, eps), None
    return _rms_norm_cuda(x, weight, eps, fp8=True)


def why_not_fp8(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernel's fp8 output mode does not take (x, weight) (checked after why_not_fused), or None."""
    h = x.shape[-1]
    if h % 128:
        return f"hidden size {h} is not a multiple of 128 (the scale blocks)"
    x2 = x.reshape(-1, h)
    ldx = x2.stride(0) if x2.shape[0] > 1 else h
    if ldx % VEC or x2.data_ptr() % 16 or weight.data_ptr() % 16:
        return "rows not 16-byte aligned (the fp8 output takes the 16-byte path only)"
    return None


def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8: bool = False) -> Any:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)                   # a view whenever the leading dims collapse
    rows = x2.shape[0]
    y = torch.empty((rows, h), dtype=torch.bfloat16, device=x.device)
    if fp8:
        from deepgemm.utils import get_tma_aligned_size

        lds = get_tma_aligned_size(rows, 4)
        q = torch.empty((rows, h), dtype=torch.float8_e4m3fn, device=x.device)
        sf = torch.empty_strided((rows, h // 128), (1, lds), dtype=torch.float32, device=x.device)
    if rows:
        ldx = x2.stride(0) if rows > 1 else h
        key = (h, ldx, x2.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0, fp8, eps, rows if fp8 else 0)
        plan = _PLANS.get(key)
        if plan is None:
            chunks = -(-h // (THREADS * VEC))
            vec = h % VEC == 0 and ldx % VEC == 0 and key[2]
            if len(_PLANS) > 256:
                _PLANS.clear()
            # The scalar arguments as tilehal.Args, made once per signature (a decode step launches 5 norms).
            scalars = (tilehal.Arg.i64(ldx), tilehal.Arg.i64(h), tilehal.Arg.f32(float(eps)),
                       tilehal.Arg.i64(1 if fp8 else 0), tilehal.Arg.i64(lds if fp8 else 0))
            plan = _PLANS[key] = (_kernel(kernel_expression(chunks, vec, fp8)), scalars)
        kern, (a_ldx, a_h, a_eps, a_rs, a_cs) = plan
        kern.launch(rows, THREADS, (x2, weight, y, rows, h, a_ldx, a_h, a_eps, q if fp8 else None,
                                    sf if fp8 else None, a_rs, a_cs))
    if not fp8:
        return y.view(x.shape)
    _PRECAST[0] = (y, _signature(y), (q, sf))
    return y.view(x.shape), (q, sf)


class FusedRMSNorm(torch.nn.Module):
    """A transformers RMSNorm (see RMSNORM_CLASSES) on one kernel; `weight` is the original's parameter.

    emit_fp8=True (register_optimizations with fp8=True and fuse_norm): the kernel also writes its output's
    per-token e4m3 cast, which the fp8 GemmLinears reading that output take instead of casting it again
    (tilestack.norm.precast_fp8); the module's output is the same bf16 tensor either way."""

    def __init__(self, norm: torch.nn.Module, emit_fp8: bool = False) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self.emit_fp8 = bool(emit_fp8)
        self._logged: set[str] = set()
        self._ok: tuple | None = None     # the last input signature the kernel took (skips the checks)

    def _run(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self._ok[-1]:
            return _rms_norm_cuda(x, w, self.variance_epsilon, fp8=True)[0]
        return _rms_norm_cuda(x, w, self.variance_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self._parameters["weight"]
        if self._ok is not None and not torch.compiler.is_compiling() and type(hidden_states) is torch.Tensor:
            sig = (hidden_states.shape, hidden_states.stride(), hidden_states.dtype, hidden_states.device,
                   w.data_ptr(), w.dtype, torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad),
                   hidden_states.data_ptr() % 16 == 0)
            if sig == self._ok[:-1]:
                return self._run(hidden_states, w)
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (hidden_states.requires_grad
                                                                         or w.requires_grad)):
            # inductor fuses the formula itself; autograd needs the torch ops.
            return rms_norm_reference(hidden_states, w, self.variance_epsilon)
        why = why_not_fused(hidden_states, w)
        if why is not None:
            if why not in self._logged:
                self._logged.add(why)
                log.debug("FusedRMSNorm: torch ops (%s)", why)
            return rms_norm_reference(hidden_states, w, self.variance_epsilon)
        fp8 = self.emit_fp8 and why_not_fp8(hidden_states, w) is None
        if self.emit_fp8 and not fp8 and "fp8" not in self._logged:
            self._logged.add("fp8")
            log.debug("FusedRMSNorm: no fused fp8 cast (%s)", why_not_fp8(hidden_states, w))
        self._ok = (hidden_states.shape, hidden_states.stride(), hidden_states.dtype, hidden_states.device,
                    w.data_ptr(), w.dtype, False, hidden_states.data_ptr() % 16 == 0, fp8)
        return self._run(hidden_states, w)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}" + (", emit_fp8" if self.emit_fp8 else "")


def rmsnorm_skip_reason(module: torch.nn.Module) -> str | None:
    """Why `module` is not an RMSNorm FusedRMSNorm reproduces, or None."""
    if type(module).__name__ not in RMSNORM_CLASSES:
        return f"{type(module).__name__} is not one of {sorted(RMSNORM_CLASSES)}"
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return "no 1-D weight"
    if not isinstance(getattr(module, "variance_epsilon", None), float | int):
        return "no variance_epsilon"
    return None
