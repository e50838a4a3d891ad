"""Plot the issue-17 target rows from bench_models JSON files: speedup over the peer per row and run.

    python benchmarks/plot_issue17.py docs/benchmarks/issue17/bench_models_h200_*.json \
        --out docs/benchmarks/issue17/issue17_h200.png

Each file is one run (its name's last `_`-separated part labels it); rows with a speedup are drawn as
grouped bars (workload / variant), with the targets as dashed lines where the issue states one. The R1
baseline (before the host/cast work) was recorded as a log only; pass it with --baseline LABEL=FILE.log to
add its speedups (parsed from the printed rows).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TARGETS = {"prefill": 1.05, "decode_eager": 1.0, "decode_graph": 1.0, "compile": 1.0, "moe": 2.0}
FP8_TARGETS = {"prefill": 1.3, "compile": 1.2}  # the fp8 targets where they differ
ROW_RE = re.compile(r"^(\S+)\s+(.+?)\s+(\d+\.\d+) ms\s+peer\s+(\d+\.\d+) ms\s+(\d+\.\d+)x")


def _short(variant: str) -> str:
    return re.sub(r" \(\d+ swapped\)", "", variant).replace("tilestack_", "").replace("ExpertParallelMoE ", "")


def rows_of_json(path: Path) -> dict[str, float]:
    out = {}
    for r in json.loads(path.read_text())["rows"]:
        if r.get("speedup") and r["workload"] in TARGETS and not r["variant"].startswith(("plain", "transformers")):
            out[f"{r['workload']}\n{_short(r['variant'])}"] = r["speedup"]
    return out


def rows_of_log(path: Path) -> dict[str, float]:
    out = {}
    for line in path.read_text().splitlines():
        m = ROW_RE.match(line)
        if m and m.group(1) in TARGETS and not m.group(2).startswith(("plain", "transformers")):
            out[f"{m.group(1)}\n{_short(m.group(2))}"] = float(m.group(5))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--baseline", action="append", default=[], help="LABEL=FILE.log (rows parsed from the log)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: list[tuple[str, dict[str, float]]] = []
    for spec in args.baseline:
        label, f = spec.split("=", 1)
        runs.append((label, rows_of_log(Path(f))))
    for f in args.files:
        runs.append((Path(f).stem.split("_")[-1], rows_of_json(Path(f))))
    keys: list[str] = []
    for _, rows in runs:
        keys += [k for k in rows if k not in keys]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(keys)), 4.5))
    width = 0.8 / max(1, len(runs))
    for i, (label, rows) in enumerate(runs):
        xs = [j + i * width for j, k in enumerate(keys) if k in rows]
        ax.bar(xs, [rows[k] for k in keys if k in rows], width, label=label)
    for j, k in enumerate(keys):
        w = k.split("\n")[0]
        t = FP8_TARGETS.get(w, TARGETS.get(w)) if "fp8" in k else TARGETS.get(w)
        if t:
            ax.hlines(t, j - 0.1, j + 0.9, colors="k", linestyles="dashed", linewidth=1)
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys, fontsize=7)
    ax.set_ylabel("speedup over the peer (same run)")
    ax.set_title("issue 17 on one H200: register_optimizations vs the unmodified model (dashed: target)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
