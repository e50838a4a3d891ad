"""Shared bits of the dataengine benchmark scripts: where results go and what machine made them.

Every script prints its table; it writes JSON and PNG into docs/benchmarks/ only with `--record`
(or into $DATAENGINE_BENCH_OUT when that is set)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def out_dir() -> Path | None:
    """Where results go: $DATAENGINE_BENCH_OUT, docs/benchmarks/ with --record, else None (print only)."""
    if os.environ.get("DATAENGINE_BENCH_OUT"):
        d = Path(os.environ["DATAENGINE_BENCH_OUT"])
    elif "--record" in sys.argv[1:]:
        d = REPO / "docs" / "benchmarks"
    else:
        return None
    d.mkdir(parents=True, exist_ok=True)
    return d


def machine() -> dict:
    import torch

    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_json(name: str, payload: dict) -> Path | None:
    if out_dir() is None:
        print(f"not recorded (pass --record to write docs/benchmarks/dataengine_{name}.json)")
        return None
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


def save_figure(fig, name: str) -> None:
    """Stamp the figure with date and machine, then write it next to the JSON (only when recording)."""
    m = machine()
    stamp = f"{datetime.date.today().isoformat()}, {m.get('gpu', m['cpu'])}, {m['cpu_count']} CPU cores, torch {m['torch']}"
    fig.text(0.99, 0.01, stamp, ha="right", va="bottom", fontsize=6, color="0.4")
    path = out_dir() / name
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
