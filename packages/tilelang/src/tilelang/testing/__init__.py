"""`tilelang.testing`: what the public TileLang's tests import."""

from __future__ import annotations

import inspect
import random
import sys
from typing import Any

import numpy as np

from ..utils.tensor import torch_assert_close


def set_random_seed(seed: int = 42) -> None:
    """Seed Python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:
        pass


def main() -> None:
    """`if __name__ == "__main__": tilelang.testing.main()`: run pytest on the calling file."""
    import pytest

    caller = inspect.stack()[1].filename
    sys.exit(pytest.main([caller, "-q", *sys.argv[1:]]))


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _cuda_cc() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability() if _has_cuda() else (0, 0)


def requires_cuda(func: Any = None) -> Any:
    """pytest skip marker (or decorator) for tests that need a CUDA GPU."""
    import pytest

    mark = pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
    return mark(func) if func is not None else mark


def requires_cuda_compute_version_ge(major: int, minor: int = 0) -> Any:
    import pytest

    return pytest.mark.skipif(_cuda_cc() < (major, minor), reason=f"needs CUDA compute capability >= {major}.{minor}")


def requires_cuda_compute_version_eq(major: int, minor: int = 0) -> Any:
    import pytest

    return pytest.mark.skipif(_cuda_cc() != (major, minor), reason=f"needs CUDA compute capability {major}.{minor}")


def requires_cuda_compute_version(major: int, minor: int = 0) -> Any:
    return requires_cuda_compute_version_ge(major, minor)


__all__ = ["main", "requires_cuda", "requires_cuda_compute_version", "requires_cuda_compute_version_eq",
           "requires_cuda_compute_version_ge", "set_random_seed", "torch_assert_close"]
