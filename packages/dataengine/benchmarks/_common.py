"""Shared bits of the dataengine benchmark scripts: where results go and what machine made them."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def out_dir() -> Path:
    d = Path(os.environ.get("DATAENGINE_BENCH_OUT", REPO / "docs" / "benchmarks"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def machine() -> dict:
    import torch

    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_json(name: str, payload: dict) -> Path:
    path = out_dir() / f"dataengine_{name}.json"
    payload = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return path


def table(rows: list[dict], cols: list[str]) -> None:
    widths = [max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(f"{r.get(c, '')}".ljust(w) for c, w in zip(cols, widths)))
