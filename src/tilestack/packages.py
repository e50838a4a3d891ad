"""The TileStack distributions, their import names and what each is for."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Package:
    dist: str
    module: str
    role: str
    anchor: str


PACKAGES: tuple[Package, ...] = (
    Package("tilestack-hal", "tilehal", "devices, dtypes, C/CUDA JIT, bench", "-"),
    Package("tilestack-tilelang", "tilelang", "tile-level kernel language and compiler", "TileLang"),
    Package("tilestack-deepgemm", "deepgemm", "FP8/BF16 dense and grouped GEMM", "DeepGEMM"),
    Package("tilestack-deepep", "deepep", "MoE dispatch/combine over torch.distributed + NVLink", "DeepEP"),
    Package("tilestack-kvpool", "kvpool", "paged KV-cache pool, paged/sparse decode", "vLLM / SGLang KV caches"),
    Package("tilestack-dataengine", "dataengine", "N:M sparsity, masks, block selection, packing, data", "-"),
)


def installed_version(pkg: Package) -> str | None:
    try:
        return md.version(pkg.dist)
    except md.PackageNotFoundError:
        return None


def import_error(pkg: Package) -> str | None:
    """None when the package imports, else the error text."""
    try:
        importlib.import_module(pkg.module)
    except Exception as e:  # report any import failure: doctor must not crash
        return f"{type(e).__name__}: {e}"
    return None


_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def readme_examples(pkg: Package) -> list[str]:
    """The ```python blocks of the package's README, read from its installed metadata."""
    try:
        text = md.metadata(pkg.dist).get_payload() or md.metadata(pkg.dist).get("Description", "")
    except md.PackageNotFoundError:
        return []
    return [b for b in _BLOCK.findall(text or "")]
