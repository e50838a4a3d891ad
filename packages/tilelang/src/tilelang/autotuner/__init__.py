"""`tilelang.autotuner`: `autotune` and `AutoTuner` (see runtime/autotune.py)."""

from ..runtime.autotune import AutoTuner, AutotuneResult, autotune

__all__ = ["AutoTuner", "AutotuneResult", "autotune"]
