"""The one-CTA layout kernel of the one-process MoE path (tilestack.moe._layout_on_device) against
build_local_layout's torch ops: the same rows, bit for bit, on random routings with empty slots."""

from __future__ import annotations

import pytest
import tilehal
import torch

from tilestack import moe

nvrtc = pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")


@nvrtc
def test_layout_kernel_compiles():
    mod = moe.compile_layout()
    assert moe.layout_expression() in mod.lowered_names


def test_cpu_tensors_take_the_torch_ops():
    assert moe._layout_on_device(torch.zeros(4, 2, dtype=torch.int64), 8, 128) is None


def _routing(t, k, e, seed, empty=0.1, skew=False):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most pairs on two experts, some experts never chosen
        idx = torch.where(torch.rand(t, k, generator=g) < 0.7, torch.randint(0, 2, (t, k), generator=g),
                          torch.randint(0, e, (t, k), generator=g))
    else:
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    idx[torch.rand(t, k, generator=g) < empty] = -1
    return idx


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,align,skew", [(4096, 2, 8, 128, False), (300, 3, 7, 16, True), (1, 1, 4, 128, False),
                                              (5000, 8, 256, 128, False), (777, 6, 64, 64, True)])
def test_layout_kernel_equals_the_torch_ops(t, k, e, align, skew, monkeypatch):
    idx = _routing(t, k, e, seed=t + e, skew=skew).cuda()
    monkeypatch.setenv("TILESTACK_MOE_LAYOUT", "kernel")
    got = moe.build_local_layout(idx, e, alignment=align)
    monkeypatch.setenv("TILESTACK_MOE_LAYOUT", "torch")
    want = moe.build_local_layout(idx, e, alignment=align)
    assert got.m_cap == want.m_cap
    assert torch.equal(got.m_indices, want.m_indices)
    assert torch.equal(got.src_rows, want.src_rows)
    assert torch.equal(got.pair_rows, want.pair_rows)


@pytest.mark.gpu
def test_layout_kernel_with_every_slot_empty(monkeypatch):
    monkeypatch.setenv("TILESTACK_MOE_LAYOUT", "kernel")
    idx = torch.full((50, 2), -1, dtype=torch.int64, device="cuda")
    lay = moe.build_local_layout(idx, 8, alignment=128)
    assert bool((lay.m_indices == -1).all()) and bool((lay.src_rows == 0).all())
    assert bool((lay.pair_rows == lay.m_cap).all())
