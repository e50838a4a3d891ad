"""Root conftest: `gpu` / `multi_gpu` tests skip cleanly where CUDA (or a second GPU) is absent,
and hypothesis runs under a named profile.

Profiles: "ci" replays the same examples on every run (derandomized, no example database, no
deadline, failing examples printed as a reproduction blob); "dev" (the default) draws fresh
examples each run and remembers failures in .hypothesis/. CI=1 or HYPOTHESIS_PROFILE=ci selects
"ci"; the nox sessions and .ci/run set it.
"""

import os

import pytest

try:
    from hypothesis import settings as _hyp_settings
except ImportError:  # a package whose tests do not use hypothesis
    _hyp_settings = None

if _hyp_settings is not None:
    _hyp_settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
    _hyp_settings.register_profile("dev", deadline=None, print_blob=True)
    _default = "ci" if os.environ.get("CI", "").lower() not in ("", "0", "false") else "dev"
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))


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
