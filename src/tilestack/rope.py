"""Rotary position embedding in one kernel, inside transformers' attention blocks (Llama, Mistral, Qwen2).

transformers applies RoPE as

    q_embed = (q * cos) + (rotate_half(q) * sin),   rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])

(and the same for k): for bf16 q and k about ten kernels (mul, two slices, neg, cat, mul, add per tensor),
each reading and writing whole activation tensors. The CUDA kernel (NVRTC through tilehal, sm_90a) rotates q
and k in place in the projections' output, both in one launch, with the same roundings as those torch ops (each
product rounded to bf16, then their sum), so its output is bit for bit theirs.

`fuse_rope_attention(module)` turns one of ROPE_ATTENTION_CLASSES in place into its `FusedRoPE*` subclass,
whose forward is the class's own with that one step replaced (children, parameters and state_dict unchanged).
The kernel runs for CUDA bf16 inputs without autograd; anything else, and everything under torch.compile
(inductor fuses the formula itself), runs the torch formula, the reason logged at DEBUG once.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import tilehal
import torch

log = logging.getLogger("tilestack.rope")

THREADS = 256
VEC = 8                      # bf16 elements per 16-byte load


def _no_window(module: torch.nn.Module) -> dict:
    return {}


def _config_window(module: torch.nn.Module) -> dict:
    return {"sliding_window": getattr(module.config, "sliding_window", None)}


def _module_window(module: torch.nn.Module) -> dict:
    return {"sliding_window": module.sliding_window}


# transformers 5 attention classes whose forward is: q/k/v projections, apply_rotary_pos_emb, cache.update, the
# configured attention interface, o_proj — differing only in the attention call's sliding_window argument (checked
# against each class's own forward in tests/test_rope.py).
ROPE_ATTENTION_CLASSES: dict[str, Callable[[torch.nn.Module], dict]] = {
    "LlamaAttention": _no_window,
    "MistralAttention": _config_window,
    "Qwen2Attention": _module_window,
}

KERNEL_SOURCE = r"""
#include <tilehal/tilehal.cuh>

namespace tilestack {

// One thread per (token, head, 8-element chunk of the first half): it rotates the chunk's 8 pairs (i, i + d/2)
// in place. Heads [0, hq) are q's (row stride ldq), [hq, hq + hk) k's (ldk); cos / sin rows are [d] at
// cs_b * (token / seq) + d * (token % seq) (cs_b = 0: one row set for the whole batch). The roundings are the
// torch ops': bf16(x * cos) + bf16(rotate_half(x) * sin), the sum rounded to bf16.
__global__ void __launch_bounds__(256) rope_bf16(__nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ k,
                                                 const __nv_bfloat16* __restrict__ cos_,
                                                 const __nv_bfloat16* __restrict__ sin_, long long tokens, int seq,
                                                 int hq, int hk, int d, long long ldq, long long ldk, long long cs_b) {
  const int chunks = d / 16;                       // 8-element chunks of one half
  const long long per_token = static_cast<long long>(hq + hk) * chunks;
  const long long item = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= tokens * per_token) return;
  const long long t = item / per_token;
  const int r = static_cast<int>(item - t * per_token);
  const int head = r / chunks, c = r - head * chunks;
  __nv_bfloat16* x = head < hq ? q + t * ldq + static_cast<long long>(head) * d
                               : k + t * ldk + static_cast<long long>(head - hq) * d;
  const long long crow = cs_b * (t / seq) + static_cast<long long>(d) * (t % seq);
  const int lo = c * 8, hi = lo + d / 2;
  float xl[8], xh[8], cl[8], ch[8], sl[8], sh[8], ol[8], oh[8];
  tilehal::load8<__nv_bfloat16, true>(x, lo, d, xl);
  tilehal::load8<__nv_bfloat16, true>(x, hi, d, xh);
  tilehal::load8<__nv_bfloat16, true>(cos_ + crow, lo, d, cl);
  tilehal::load8<__nv_bfloat16, true>(cos_ + crow, hi, d, ch);
  tilehal::load8<__nv_bfloat16, true>(sin_ + crow, lo, d, sl);
  tilehal::load8<__nv_bfloat16, true>(sin_ + crow, hi, d, sh);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float a = __bfloat162float(__float2bfloat16_rn(__fmul_rn(xl[i], cl[i])));
    const float b = __bfloat162float(__float2bfloat16_rn(__fmul_rn(-xh[i], sl[i])));
    ol[i] = __fadd_rn(a, b);
    const float e = __bfloat162float(__float2bfloat16_rn(__fmul_rn(xh[i], ch[i])));
    const float f = __bfloat162float(__float2bfloat16_rn(__fmul_rn(xl[i], sh[i])));
    oh[i] = __fadd_rn(e, f);
  }
  tilehal::store8<__nv_bfloat16, true>(x, lo, d, ol);
  tilehal::store8<__nv_bfloat16, true>(x, hi, d, oh);
}

}  // namespace tilestack
"""

KERNEL_EXPRESSION = "tilestack::rope_bf16"


def compile_module():
    """NVRTC module (sm_90a; cached on disk by content, no GPU needed)."""
    return tilehal.compile_cuda(KERNEL_SOURCE, arch="sm_90a", name="tilestack_rope", options=("-std=c++17",),
                                name_expressions=[KERNEL_EXPRESSION])


@functools.lru_cache(maxsize=1)
def _kernel():
    return compile_module().get_kernel(KERNEL_EXPRESSION)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb (unsqueeze_dim=1) op for op: q [b, hq, s, d], k [b, hk, s, d],
    cos / sin [b or 1, s, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _rows(x: torch.Tensor, tokens: int) -> int | None:
    """The row stride of x [b, s, n] viewed as [tokens, n] rows, or None when no single stride does."""
    if x.dim() != 3 or x.stride(-1) != 1:
        return None
    b, s, _ = x.shape
    if s > 1 and b > 1 and x.stride(0) != s * x.stride(1):
        return None
    return x.stride(1) if s > 1 else (x.stride(0) if b > 1 else x.shape[-1])


def why_not_fused(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> str | None:
    """Why the kernel does not rotate the projections q [b, s, hq * d] and k [b, s, hk * d] with cos / sin
    [b or 1, s, d] in place, or None."""
    if not (q.is_cuda and k.is_cuda and cos.is_cuda and sin.is_cuda):
        return "tensors not all on CUDA (the kernel is CUDA)"
    if any(t.dtype is not torch.bfloat16 for t in (q, k, cos, sin)):
        return f"dtypes q {q.dtype} / k {k.dtype} / cos {cos.dtype} / sin {sin.dtype} (the kernel takes bf16)"
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        return "tensors on different devices"
    if q.dim() != 3 or k.dim() != 3 or q.shape[:2] != k.shape[:2]:
        return f"projection shapes q {tuple(q.shape)} / k {tuple(k.shape)}"
    b, s = q.shape[:2]
    d = head_dim
    if d % 16 or d <= 0 or q.shape[2] % d or k.shape[2] % d:
        return f"head_dim {d} (the kernel takes multiples of 16 dividing the projections {q.shape[2]} / {k.shape[2]})"
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1:] != (s, d) or cos.shape[0] not in (1, b):
        return f"cos / sin shapes {tuple(cos.shape)} / {tuple(sin.shape)} (expected [{b} or 1, {s}, {d}])"
    if cos.stride() != sin.stride() or cos.stride(2) != 1 or (s > 1 and cos.stride(1) != d):
        return "cos / sin not row-contiguous with equal strides"
    ldq, ldk = _rows(q, b * s), _rows(k, b * s)
    if ldq is None or ldk is None:
        return "projections not viewable as [tokens, n] rows"
    if ldq % VEC or ldk % VEC or any(t.data_ptr() % 16 for t in (q, k, cos, sin)):
        return "rows not 16-byte aligned"
    if b * s * (q.shape[2] + k.shape[2]) >= 2**31 or b * s == 0:
        return f"{b * s} tokens (the kernel takes 1 .. 2^31 elements)"
    return None


def rope_in_place(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """Rotate the projections q [b, s, hq * d] and k [b, s, hk * d] in place (why_not_fused(...) must be None)."""
    b, s = q.shape[:2]
    tokens = b * s
    hq, hk = q.shape[2] // head_dim, k.shape[2] // head_dim
    cs_b = cos.stride(0) if cos.shape[0] > 1 else 0
    items = tokens * (hq + hk) * (head_dim // 16)
    _kernel().launch(-(-items // THREADS), THREADS,
                     (q, k, cos, sin, tilehal.Arg.i64(tokens), s, hq, hk, head_dim, tilehal.Arg.i64(_rows(q, tokens)),
                      tilehal.Arg.i64(_rows(k, tokens)), tilehal.Arg.i64(cs_b)))


class FusedRoPEMixin:
    """The forward of ROPE_ATTENTION_CLASSES with RoPE rotated in place by one kernel where it applies."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache: Any = None, **kwargs: Any
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if cache is None and "past_key_values" in kwargs:   # the name transformers still accepts (deprecated)
            cache = kwargs.pop("past_key_values")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k = self.q_proj(hidden_states), self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        cos, sin = position_embeddings
        if torch.compiler.is_compiling():   # inductor fuses the torch formula itself (and logging would break graphs)
            why = "torch.compile"
        else:
            why = _why_torch(q, k, cos, sin, self.head_dim)
            if why is not None and why not in _LOGGED:
                _LOGGED.add(why)
                log.debug("%s: RoPE as torch ops (%s)", type(self).__name__, why)
        if why is None:
            rope_in_place(q, k, cos, sin, self.head_dim)
            query_states, key_states = q.view(hidden_shape).transpose(1, 2), k.view(hidden_shape).transpose(1, 2)
        else:
            query_states, key_states = rope_reference(q.view(hidden_shape).transpose(1, 2),
                                                      k.view(hidden_shape).transpose(1, 2), cos, sin)
        value_states = v.view(hidden_shape).transpose(1, 2)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    self._rope_eager_attention)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
            **self._rope_window(self), **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


_LOGGED: set[str] = set()


def _why_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> str | None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin)):
        return "autograd (the in-place kernel has no backward)"
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor:
        return "tensor subclasses"
    return why_not_fused(q, k, cos, sin, head_dim)


@functools.cache
def fused_class(cls: type) -> type:
    """The FusedRoPE subclass of one of ROPE_ATTENTION_CLASSES."""
    return type(f"FusedRoPE{cls.__name__}", (FusedRoPEMixin, cls), {
        "_rope_window": staticmethod(ROPE_ATTENTION_CLASSES[cls.__name__]),
        "_rope_eager_attention": staticmethod(sys.modules[cls.__module__].eager_attention_forward)})


def rope_skip_reason(module: torch.nn.Module) -> str | None:
    """Why `module` is not an attention block fuse_rope_attention rewrites, or None."""
    name = type(module).__name__
    if name not in ROPE_ATTENTION_CLASSES or not type(module).__module__.startswith("transformers.models."):
        return f"{name} is not one of transformers' {sorted(ROPE_ATTENTION_CLASSES)}"
    missing = [a for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "scaling", "config")
               if not hasattr(module, a)]
    if missing:
        return f"no {', '.join(missing)}"
    if getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None) is None:
        return "its modeling module has no eager_attention_forward"
    return None


def fuse_rope_attention(module: torch.nn.Module) -> torch.nn.Module:
    """Turn `module` (rope_skip_reason(module) is None) into its FusedRoPE subclass in place; returns it."""
    module.__class__ = fused_class(type(module))
    return module
