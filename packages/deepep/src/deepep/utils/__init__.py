"""DeepEP's test/benchmark helpers under its module names (`deep_ep.utils.math`, `.testing`, `.envs`), so
DeepEP users' test scripts run with `import deepep as deep_ep`."""

from . import envs, math, testing

__all__ = ["envs", "math", "testing"]
