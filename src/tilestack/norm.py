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
template <int THREADS, int CHUNKS, bool VEC>
__global__ void __launch_bounds__(THREADS) rms_norm_bf16(const __nv_bfloat16* __restrict__ x,
                                                         const __nv_bfloat16* __restrict__ w,
                                                         __nv_bfloat16* __restrict__ y, int rows, int h,
                                                         long long ldx, long long ldy, float eps) {
  __shared__ float scratch[THREADS / 32];
  const int row = blockIdx.x;
  if (row >= rows) return;
  const __nv_bfloat16* xr = x + static_cast<long long>(row) * ldx;
  __nv_bfloat16* yr = y + static_cast<long long>(row) * ldy;
  float v[CHUNKS][8];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int col = (c * THREADS + threadIdx.x) * 8;
    if (VEC && col + 7 < h) {
      const uint4 pk = *reinterpret_cast<const uint4*>(xr + col);
      const unsigned bits[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = tilehal::bf16x2_to_float2(bits[i]);
        v[c][2 * i] = f.x;
        v[c][2 * i + 1] = f.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[c][i] = col + i < h ? __bfloat162float(xr[col + i]) : 0.f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += v[c][i] * v[c][i];
  }
  ss = tilehal::block_sum(ss, scratch);
  const float r = rsqrtf(ss / static_cast<float>(h) + eps);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    const int col = (c * THREADS + threadIdx.x) * 8;
    if (col >= h) continue;
    float o[8];
    if (VEC && col + 7 < h) {
      const uint4 pk = *reinterpret_cast<const uint4*>(w + col);
      const unsigned bits[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = tilehal::bf16x2_to_float2(bits[i]);
        o[2 * i] = __bfloat162float(__float2bfloat16_rn(v[c][2 * i] * r)) * f.x;
        o[2 * i + 1] = __bfloat162float(__float2bfloat16_rn(v[c][2 * i + 1] * r)) * f.y;
      }
      uint4 out;
      out.x = tilehal::float2_to_bf16x2(o[0], o[1]);
      out.y = tilehal::float2_to_bf16x2(o[2], o[3]);
      out.z = tilehal::float2_to_bf16x2(o[4], o[5]);
      out.w = tilehal::float2_to_bf16x2(o[6], o[7]);
      *reinterpret_cast<uint4*>(yr + col) = out;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (col + i < h) {
          const float n = __bfloat162float(__float2bfloat16_rn(v[c][i] * r));
          yr[col + i] = __float2bfloat16_rn(n * __bfloat162float(w[col + i]));
        }
      }
    }
  }
}

}  // namespace tilestack
"""


def kernel_expression(chunks: int, vec: bool) -> str:
    return f"tilestack::rms_norm_bf16<{THREADS}, {chunks}, {'true' if vec else 'false'}>"


def all_expressions() -> list[str]:
    return [kernel_expression(c, v) for c in range(1, MAX_CHUNKS + 1) for v in (True, False)]


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of x [..., H] with weight [H]: one kernel where `why_not_fused` is None, else
    the torch formula (rms_norm_reference)."""
    why = why_not_fused(x, weight)
    if why is not None:
        log.debug("rms_norm: torch ops (%s)", why)
        return rms_norm_reference(x, weight, eps)
    return _rms_norm_cuda(x, weight, eps)


def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    x2 = x.reshape(-1, h)                   # a view whenever the leading dims collapse
    rows = x2.shape[0]
    y = torch.empty((rows, h), dtype=torch.bfloat16, device=x.device)
    if rows:
        ldx = x2.stride(0) if rows > 1 else h
        key = (h, ldx, x2.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)
        plan = _PLANS.get(key)
        if plan is None:
            chunks = -(-h // (THREADS * VEC))
            vec = h % VEC == 0 and ldx % VEC == 0 and key[2]
            plan = _PLANS[key] = (_kernel(kernel_expression(chunks, vec)),)
        plan[0].launch(rows, THREADS, (x2, weight, y, rows, h, tilehal.Arg.i64(ldx), tilehal.Arg.i64(h),
                                       tilehal.Arg.f32(float(eps))))
    return y.view(x.shape)


class FusedRMSNorm(torch.nn.Module):
    """A transformers RMSNorm (see RMSNORM_CLASSES) on one kernel; `weight` is the original's parameter."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self._logged: set[str] = set()
        self._ok: tuple | None = None     # the last input signature the kernel took (skips the checks)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self._parameters["weight"]
        if self._ok is not None and not torch.compiler.is_compiling() and type(hidden_states) is torch.Tensor:
            sig = (hidden_states.shape, hidden_states.stride(), hidden_states.dtype, hidden_states.device,
                   w.data_ptr(), w.dtype, torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad))
            if sig == self._ok:
                return _rms_norm_cuda(hidden_states, w, self.variance_epsilon)
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
        self._ok = (hidden_states.shape, hidden_states.stride(), hidden_states.dtype, hidden_states.device,
                    w.data_ptr(), w.dtype, False)
        return _rms_norm_cuda(hidden_states, w, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


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
