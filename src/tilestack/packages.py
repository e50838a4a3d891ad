"""The TileStack distributions, their import names and what each is for."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import re
from dataclasses import dataclass
from pathlib import Path


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


def _readme_text(pkg: Package) -> str:
    """The package's README: from its source folder for a local (editable) install, so the text is
    current, else from the installed metadata."""
    dist = md.distribution(pkg.dist)
    direct = dist.read_text("direct_url.json")
    if direct:
        url = json.loads(direct).get("url", "")
        if url.startswith("file://"):
            readme = Path(url[len("file://"):]) / "README.md"
            if readme.exists():
                return readme.read_text()
    meta = dist.metadata
    return meta.get_payload() or meta.get("Description", "") or ""


def readme_examples(pkg: Package) -> list[str]:
    """The ```python blocks of the package's README."""
    try:
        text = _readme_text(pkg)
    except md.PackageNotFoundError:
        return []
    return _BLOCK.findall(text)
