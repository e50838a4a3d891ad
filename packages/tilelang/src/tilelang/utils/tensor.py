"""Tensor helpers: dtype mapping and a closeness assertion with a mismatch budget."""

from __future__ import annotations

from typing import Any

import tilehal

from ..ir import dtypes as dt
from ..profiler import Profiler, TensorSupplyType


def map_torch_type(name: Any) -> Any:
    """The torch dtype for a tilelang dtype name ("float16", T.float8_e4m3fn, ...)."""
    return tilehal.to_torch_dtype(dt.canonical(name))


def torch_assert_close(actual: Any, expected: Any, rtol: float = 1e-2, atol: float = 1e-2,
                       max_mismatched_ratio: float = 0.001, verbose: bool = False, equal_nan: bool = True,
                       check_device: bool = True, base_name: str = "LHS", ref_name: str = "RHS") -> None:
    """Like torch.testing.assert_close, but passes when at most `max_mismatched_ratio` of the elements
    fall outside atol + rtol * |expected| (the public TileLang's semantics)."""
    import torch

    if actual.shape != expected.shape:
        raise AssertionError(f"torch_assert_close: shape {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if check_device and actual.device != expected.device:
        raise AssertionError(f"torch_assert_close: device {actual.device} vs {expected.device}")
    a, b = actual.detach().double(), expected.detach().double()
    bad = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan)
    n_bad, total = int(bad.sum()), bad.numel()
    if verbose:
        print(f"torch_assert_close: {n_bad} of {total} elements beyond atol={atol}, rtol={rtol}")
    if total and n_bad / total > max_mismatched_ratio:
        diff = (a - b).abs().masked_fill(~bad, 0)
        i = int(diff.argmax())
        raise AssertionError(f"Tensor-likes are not close: {n_bad} of {total} elements ({n_bad / total:.2%}) exceed "
                             f"atol={atol}, rtol={rtol} (allowed {max_mismatched_ratio:.2%}); worst: {base_name} "
                             f"{a.flatten()[i].item()} vs {ref_name} {b.flatten()[i].item()} at flat index {i}")


def get_tensor_supply(supply_type: TensorSupplyType = TensorSupplyType.Integer, seed: int = 0) -> Any:
    """A function parameter -> random tensor (a kernel's `params` entries), as the profiler fills inputs."""
    gen = Profiler(None, supply_type, {}, seed=seed)

    def supply(param: Any) -> Any:
        return gen._make(param)

    return supply


__all__ = ["TensorSupplyType", "get_tensor_supply", "map_torch_type", "torch_assert_close"]
