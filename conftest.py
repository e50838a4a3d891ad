"""Root conftest: `gpu` / `multi_gpu` tests skip cleanly where CUDA (or a second GPU) is absent."""

import pytest


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    count = _cuda_device_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and count == 0:
            item.add_marker(skip_gpu)
        elif "multi_gpu" in item.keywords and count < 2:
            item.add_marker(skip_multi)
