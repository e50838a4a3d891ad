"""`tilelang.utils`: the host-side helpers the public TileLang's examples import."""

from __future__ import annotations

from ..profiler import TensorSupplyType
from .math import cdiv, next_power_of_2
from .tensor import map_torch_type, torch_assert_close

__all__ = ["TensorSupplyType", "cdiv", "map_torch_type", "next_power_of_2", "torch_assert_close"]
