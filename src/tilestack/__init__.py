"""TileStack umbrella: composes the peers (register_optimizations, ExpertParallelMoE) and the CLI.

The composition API is imported lazily so `tilestack doctor` does not pull in torch and every peer.
"""

import importlib

from .__about__ import __version__

_LAZY = {
    "register_optimizations": ".optimize",
    "OptimizationReport": ".optimize",
    "GemmLinear": ".layers",
    "ExpertParallelMoE": ".moe",
    "ReferenceMoE": ".moe",
    "profile": ".profiling",
    "ProfileReport": ".profiling",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'tilestack' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
