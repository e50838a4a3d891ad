"""Shared helpers for deepgemm's tests: random operands and the float64 oracle."""

from __future__ import annotations

from types import SimpleNamespace

import deepgemm
import pytest
import torch


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def fp8_operands(m: int, n: int, k: int, device: str = "cpu", seed: int = 0, groups: int | None = None):
    """(a_fp8, sfa, b_fp8, sfb, a_ref, b_ref); groups makes b [G, N, K]."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn((m, k), generator=g, dtype=torch.float32).to(torch.bfloat16)
    bshape = (n, k) if groups is None else (groups, n, k)
    b = torch.randn(bshape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    b8, sfb = deepgemm.per_block_cast_to_fp8(b)
    return tuple(t.to(device) for t in (a8, sfa, b8, sfb))


def dequant_a(a8: torch.Tensor, sfa: torch.Tensor) -> torch.Tensor:
    """float64 A from 1x128 scales (last dim K)."""
    k = a8.shape[-1]
    return a8.double() * sfa.double().repeat_interleave(128, dim=-1)[..., :k]


def dequant_b(b8: torch.Tensor, sfb: torch.Tensor) -> torch.Tensor:
    """float64 B from 128x128 scales (last two dims N, K)."""
    n, k = b8.shape[-2:]
    s = sfb.double().repeat_interleave(128, dim=-1)[..., :k].repeat_interleave(128, dim=-2)[..., :n, :]
    return b8.double() * s


def oracle_fp8(a8, sfa, b8, sfb, c=None) -> torch.Tensor:
    """float64 C + A @ B^T of the dequantized operands (independent of deepgemm's code)."""
    out = dequant_a(a8.cpu(), sfa.cpu()) @ dequant_b(b8.cpu(), sfb.cpu()).T
    return out if c is None else out + c.cpu().double()


def check_compiled(mod, exprs, forbidden=("serialized",)) -> None:
    """A compile-only test's checks of an NVRTC module built with --ptxas-options=-v: every kernel of
    `exprs` is in it and, when this run compiled it (a cache hit has no ptxas report), ptxas reported
    each kernel with 0 bytes of spill stores and none of the `forbidden` warnings (e.g. "serialized":
    wgmma made synchronous)."""
    assert all(e in mod.lowered_names for e in exprs)
    if mod.cache_hit:
        return
    spills = [line for line in mod.log.splitlines() if "spill" in line]
    assert len(spills) == len(exprs) and all("0 bytes spill stores" in line for line in spills), mod.log
    for text in forbidden:
        assert text not in mod.log, mod.log


def check_compiled_batches(compile_kernels, keys, size: int = 8, forbidden=("serialized",)) -> None:
    """check_compiled over `keys` (objects with .expression) compiled `size` at a time by
    compile_kernels(batch, extra_options), as the split-K and 1D1D modules build them."""
    for i in range(0, len(keys), size):
        batch = keys[i:i + size]
        check_compiled(compile_kernels(batch, ("--ptxas-options=-v",)), [k.expression for k in batch], forbidden)


def check_graph_replay(fn, out, label: str, replays: int = 3) -> None:
    """Run fn() once eagerly (compiles outside the capture), capture it in a CUDA graph on a side stream,
    zero `out`, and check that every replay writes the eager result bit for bit."""
    fn()
    want = out.clone()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            fn()
    out.zero_()
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        deepgemm.testing.assert_bitwise_equal(out, want, label)


@pytest.fixture
def h():
    """The helpers above, for test modules (importlib mode forbids importing conftest)."""
    return SimpleNamespace(fp8_operands=fp8_operands, dequant_a=dequant_a, dequant_b=dequant_b,
                           oracle_fp8=oracle_fp8, check_compiled=check_compiled,
                           check_compiled_batches=check_compiled_batches, check_graph_replay=check_graph_replay)
