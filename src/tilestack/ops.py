"""The stack's operators as `torch.library` custom ops (namespace `tilestack`), with fake implementations.

`torch.compile(model, fullgraph=True)` cannot trace into deepgemm's launch code (host checks,
cached kernels, driver calls) or kvpool's pool object; as custom ops they are opaque nodes whose
output shapes the fake (meta) implementations give, so an optimized model compiles into one graph
and CUDA-graph capture (`mode="reduce-overhead"`) sees plain tensor ops. Each op's real
implementation calls the package's public API, which picks the sm_90a kernel for CUDA tensors and
the reference for CPU tensors.

Tensor-level ops (usable on their own):

| op | calls |
| --- | --- |
| `tilestack::bf16_gemm_nt(a, b, out_dtype)` | `deepgemm.bf16_gemm_nt` (a [M, K] @ b [N, K].T); autograd: two GEMMs |
| `tilestack::fp8_gemm_nt(a, sfa, b, sfb, out_dtype)` | `deepgemm.fp8_gemm_nt` |
| `tilestack::m_grouped_bf16_gemm_nt_contiguous(a, b, m_indices)` | deepgemm's grouped GEMM (bf16 out) |
| `tilestack::m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, m_indices)` | same, fp8 operands |
| `tilestack::per_token_cast_to_fp8(x)` / `per_block_cast_to_fp8(x)` | deepgemm's casts |
| `tilestack::select_blocks(q, kmin, kmax, block_table, seq_lens, top_k, sink, local, block_size)` | `dataengine.select_blocks` |

Object-level ops: state that is not a tensor (a `kvpool.KVPool`, a layer's cached fp8 weights, a
deepep `Buffer`) is found through an integer handle (`handle_of(obj)`; a weak reference, so the op
never keeps its object alive), while the tensors the op reads travel as arguments so the graph
orders it after the writes it depends on (the approach vLLM takes with layer names):

| op | calls |
| --- | --- |
| `tilestack::paged_decode(q, k_cache, v_cache, block_table, seq_lens, block_indices, pool, layer, scale)` | `kvpool.paged_decode` |
| `tilestack::paged_prefill(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, pool, layer, scale)` | `kvpool.paged_prefill` |
| `tilestack::gemm_linear(x, weight, bias, layer)` | `GemmLinear`'s eager forward (its cached operands) |
| `tilestack::moe_experts(x, topk_idx, topk_weights, w13, w2, layer)` | `ExpertParallelMoE`'s dispatch (deepep or one-rank), grouped GEMMs, combine |

deepep's dispatch and combine have data-dependent shapes (how many tokens a rank receives); inside
`moe_experts` they meet the static [T, hidden] in and out, which is what a graph needs.

Autograd: `bf16_gemm_nt` has its backward (dA = dD @ B, dB = dD.T @ A, both through the same op);
every other op raises `AutogradUnsupportedError` naming the op when a backward reaches it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from tilehal import TileStackError

_NS = "tilestack"


class AutogradUnsupportedError(TileStackError, RuntimeError):
    """A backward pass reached a tilestack op that records no gradient."""


# ----------------------------------------------------------------------------- handles

_HANDLES: dict[int, weakref.ref] = {}
_NEXT = itertools.count(1)


@torch.compiler.assume_constant_result   # under torch.compile: run once while tracing, the int baked in
def handle_of(obj: Any) -> int:
    """A process-local integer naming `obj` for the object-level ops (made once, kept on the object)."""
    h = getattr(obj, "_tilestack_handle", None)
    if h is None or lookup(h, missing_ok=True) is not obj:
        h = next(_NEXT)
        _HANDLES[h] = weakref.ref(obj, lambda _, h=h: _HANDLES.pop(h, None))
        object.__setattr__(obj, "_tilestack_handle", h)
    return h


def lookup(handle: int, missing_ok: bool = False) -> Any:
    ref = _HANDLES.get(handle)
    obj = ref() if ref is not None else None
    if obj is None and not missing_ok:
        raise TileStackError(f"handle: expected a live tilestack object handle, got {handle} (its object is gone)")
    return obj


def _no_backward(name: str):
    def backward(ctx, *grads):
        raise AutogradUnsupportedError(
            f"tilestack::{name} records no gradient (inference only): run the model under torch.no_grad() / "
            "torch.inference_mode(), or keep the original modules for training")
    return backward


def _refuse_autograd(op, name: str) -> None:
    op.register_autograd(_no_backward(name), setup_context=lambda ctx, inputs, output: None)


# ----------------------------------------------------------------------------- deepgemm


@torch.library.custom_op(f"{_NS}::bf16_gemm_nt", mutates_args=())
def bf16_gemm_nt(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [N, K].T -> [M, N] in out_dtype (fp32 accumulation), bf16 operands."""
    import deepgemm

    d = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    if a.shape[0] and b.shape[0]:
        deepgemm.bf16_gemm_nt(a.to(torch.bfloat16).contiguous(), b.to(torch.bfloat16).contiguous(), d)
    elif a.shape[0]:
        d.zero_()
    return d


@bf16_gemm_nt.register_fake
def _(a, b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _bf16_gemm_setup(ctx, inputs, output):
    a, b, _ = inputs
    ctx.save_for_backward(a, b)


def _bf16_gemm_backward(ctx, grad):
    a, b = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = bf16_gemm_nt(grad, b.t().contiguous(), torch.float32).to(a.dtype)     # dD [M, N] @ B [N, K]
    if ctx.needs_input_grad[1]:
        gb = bf16_gemm_nt(grad.t().contiguous(), a.t().contiguous(), torch.float32).to(b.dtype)  # dD.T @ A
    return ga, gb, None


bf16_gemm_nt.register_autograd(_bf16_gemm_backward, setup_context=_bf16_gemm_setup)


@torch.library.custom_op(f"{_NS}::fp8_gemm_nt", mutates_args=())
def fp8_gemm_nt(a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """(a e4m3 [M, K], sfa [M, K/128]) x (b e4m3 [N, K], sfb [N/128, K/128]) -> [M, N]."""
    import deepgemm

    d = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)
    if a.shape[0]:
        deepgemm.fp8_gemm_nt((a, sfa), (b, sfb), d)
    return d


@fp8_gemm_nt.register_fake
def _(a, sfa, b, sfb, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.library.custom_op(f"{_NS}::per_token_cast_to_fp8", mutates_args=())
def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)])."""
    import deepgemm

    return deepgemm.per_token_cast_to_fp8(x)


@per_token_cast_to_fp8.register_fake
def _(x):
    *lead, m, k = x.shape
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((*lead, m, -(-k // 128)), dtype=torch.float32))


@torch.library.custom_op(f"{_NS}::per_block_cast_to_fp8", mutates_args=())
def per_block_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N, K] -> (e4m3 [..., N, K], fp32 scales [..., ceil(N/128), ceil(K/128)])."""
    import deepgemm

    return deepgemm.per_block_cast_to_fp8(x)


@per_block_cast_to_fp8.register_fake
def _(x):
    *lead, n, k = x.shape
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((*lead, -(-n // 128), -(-k // 128)), dtype=torch.float32))


@torch.library.custom_op(f"{_NS}::m_grouped_bf16_gemm_nt_contiguous", mutates_args=())
def m_grouped_bf16_gemm_nt_contiguous(a: torch.Tensor, b: torch.Tensor, m_indices: torch.Tensor) -> torch.Tensor:
    """a [M_sum, K] rows grouped per expert (m_indices int32, -1 padding), b [E, N, K] -> bf16 [M_sum, N]."""
    import deepgemm

    d = torch.empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    if a.shape[0]:
        deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)
    return d


@m_grouped_bf16_gemm_nt_contiguous.register_fake
def _(a, b, m_indices):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


@torch.library.custom_op(f"{_NS}::m_grouped_fp8_gemm_nt_contiguous", mutates_args=())
def m_grouped_fp8_gemm_nt_contiguous(a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor,
                                     m_indices: torch.Tensor) -> torch.Tensor:
    import deepgemm

    d = torch.empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16, device=a.device)
    if a.shape[0]:
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, m_indices)
    return d


@m_grouped_fp8_gemm_nt_contiguous.register_fake
def _(a, sfa, b, sfb, m_indices):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- dataengine


@torch.library.custom_op(f"{_NS}::select_blocks", mutates_args=())
def select_blocks(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, top_k: int, sink_blocks: int = 1, local_blocks: int = 1,
                  block_size: int | None = None) -> torch.Tensor:
    """dataengine Quest selection: int32 [B, kv_heads, min(budget, max_blocks)] block positions."""
    import dataengine

    return dataengine.select_blocks(q, kmin, kmax, block_table, seq_lens, top_k, sink_blocks, local_blocks,
                                    block_size)


@select_blocks.register_fake
def _(q, kmin, kmax, block_table, seq_lens, top_k, sink_blocks=1, local_blocks=1, block_size=None):
    n = min(max(top_k, sink_blocks + local_blocks), block_table.shape[1])
    return q.new_empty((q.shape[0], kmin.shape[1], n), dtype=torch.int32)


# ----------------------------------------------------------------------------- kvpool


@torch.library.custom_op(f"{_NS}::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, block_indices: torch.Tensor | None, pool: int, layer: int,
                 scale: float | None = None) -> torch.Tensor:
    """kvpool.paged_decode on the pool `pool` names (k_cache / v_cache: that pool's caches)."""
    import kvpool

    p = lookup(pool)
    return kvpool.paged_decode(q, p, layer, block_table, seq_lens, scale, block_indices)


@paged_decode.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, block_indices, pool, layer, scale=None):
    return torch.empty_like(q)


@torch.library.custom_op(f"{_NS}::paged_prefill", mutates_args=())
def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, pool: int, layer: int,
                  scale: float | None = None) -> torch.Tensor:
    """kvpool.paged_prefill on the pool `pool` names."""
    import kvpool

    p = lookup(pool)
    return kvpool.paged_prefill(q, p, layer, block_table, seq_lens, cu_seqlens_q, scale)


@paged_prefill.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, pool, layer, scale=None):
    return torch.empty_like(q)


def pool_decode(q: torch.Tensor, pool: Any, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                scale: float | None = None, block_indices: torch.Tensor | None = None) -> torch.Tensor:
    """`kvpool.paged_decode` through the op (what compiled code calls)."""
    return torch.ops.tilestack.paged_decode(q, pool.k_cache, pool.v_cache, block_table, seq_lens, block_indices,
                                            handle_of(pool), layer, scale)


def pool_prefill(q: torch.Tensor, pool: Any, layer: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """`kvpool.paged_prefill` through the op."""
    return torch.ops.tilestack.paged_prefill(q, pool.k_cache, pool.v_cache, block_table, seq_lens, cu_seqlens_q,
                                             handle_of(pool), layer, scale)


# ----------------------------------------------------------------------------- layers


@torch.library.custom_op(f"{_NS}::gemm_linear", mutates_args=())
def gemm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: int) -> torch.Tensor:
    """GemmLinear `layer`'s eager forward on x [M, in] (its cached bf16 / fp8 weight operand)."""
    return lookup(layer)._forward_2d(x)


@gemm_linear.register_fake
def _(x, weight, bias, layer):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op(f"{_NS}::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, layer: int) -> torch.Tensor:
    """ExpertParallelMoE `layer`: dispatch, grouped GEMMs, combine of x [T, hidden] -> bf16 [T, hidden]."""
    return lookup(layer)._routed(x, topk_idx, topk_weights)


@moe_experts.register_fake
def _(x, topk_idx, topk_weights, w13, w2, layer):
    return x.new_empty(x.shape, dtype=torch.bfloat16)


for _op, _name in ((fp8_gemm_nt, "fp8_gemm_nt"), (per_token_cast_to_fp8, "per_token_cast_to_fp8"),
                   (per_block_cast_to_fp8, "per_block_cast_to_fp8"),
                   (m_grouped_bf16_gemm_nt_contiguous, "m_grouped_bf16_gemm_nt_contiguous"),
                   (m_grouped_fp8_gemm_nt_contiguous, "m_grouped_fp8_gemm_nt_contiguous"),
                   (select_blocks, "select_blocks"), (paged_decode, "paged_decode"),
                   (paged_prefill, "paged_prefill"), (gemm_linear, "gemm_linear"), (moe_experts, "moe_experts")):
    _refuse_autograd(_op, _name)
