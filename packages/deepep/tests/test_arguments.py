"""Every public entry point of deepep on a Buffer of one rank (the local engine, no torch.distributed
in this process), each argument replaced in turn by a bad value (wrong type, NaN, 0, -1, huge, empty
/ NaN tensors): the call succeeds or raises a TileStackError naming the argument, never a raw
torch/Python exception or a hang (issue 16, the per-package sweep; deepep's multi-rank fuzz test of
dispatch is test_fuzz.py). Each case builds a fresh Buffer and inputs."""

import pytest
import torch
from deepep import Buffer, per_token_cast_back, per_token_cast_to_fp8
from tilehal.testing import probe_arguments

E, T, H, K = 8, 6, 128, 2


def _inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[1, 1] = -1  # an empty slot
    return x, idx, torch.rand(T, K, generator=g)


def _buffer(**kw):
    return Buffer(None, transport="local", timeout_s=5.0, num_max_tokens_per_rank=64, **kw)


def _layout():
    buf = _buffer()
    x, idx, w = _inputs()
    _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    return buf, x, idx, w, per_expert, in_rank


def _dispatch():
    buf, x, idx, w, per_expert, in_rank = _layout()
    return buf.dispatch, dict(x=x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                              is_token_in_rank=in_rank, expert_alignment=1, num_worst_tokens=0)


def _combine():
    buf, x, idx, w, per_expert, in_rank = _layout()
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                                   is_token_in_rank=in_rank)
    return buf.combine, dict(x=recv_x, handle=handle, topk_weights=recv_w)


def _ll_dispatch():
    buf = _buffer(low_latency_mode=True)
    x, idx, _ = _inputs()
    return buf.low_latency_dispatch, dict(x=x, topk_idx=idx, num_max_dispatch_tokens_per_rank=16, num_experts=E,
                                          use_fp8=False)


def _ll_combine():
    buf = _buffer(low_latency_mode=True)
    x, idx, w = _inputs()
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 16, E, use_fp8=False)
    return buf.low_latency_combine, dict(x=recv_x, topk_idx=idx, topk_weights=w, handle=handle)


def _cast_back():
    xq, s = per_token_cast_to_fp8(torch.randn(4, 256))
    return per_token_cast_back, dict(x_fp8=xq, scales=s)


CASES = {
    "Buffer": lambda: (_buffer, dict(low_latency_mode=False, num_nvl_bytes=0)),
    "get_dispatch_layout": lambda: (lambda: _layout()[0].get_dispatch_layout, None),
    "dispatch": _dispatch,
    "combine": _combine,
    "low_latency_dispatch": _ll_dispatch,
    "low_latency_combine": _ll_combine,
    "per_token_cast_to_fp8": lambda: (per_token_cast_to_fp8, dict(x=torch.randn(4, 256), round_scale=False)),
    "per_token_cast_back": _cast_back,
}


def _fresh(name):
    fn, kwargs = CASES[name]()
    if name == "get_dispatch_layout":
        fn, kwargs = fn(), dict(topk_idx=_inputs()[1], num_experts=E)
    return fn, kwargs


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_arguments_raise_the_stacks_errors(name):
    fn, kwargs = _fresh(name)
    fn(**kwargs)  # the baseline is valid
    assert probe_arguments(fn, kwargs, fresh=lambda: _fresh(name)) == []
