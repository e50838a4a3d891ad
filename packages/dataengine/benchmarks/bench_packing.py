"""Packing efficiency: best-fit-decreasing packing vs padding on a long-tailed length mix.

Lengths: 90% lognormal "chat/web" samples plus 10% long documents up to 32K, truncated to the
row length. Reported: share of slots holding real tokens (1.0 = no padding), rows needed, and
the time BFD takes.
"""

from __future__ import annotations

import time

import numpy as np
from _common import out_dir, save_figure, table, write_json
from dataengine.packing import best_fit_decreasing, packing_efficiency, padding_efficiency


def lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = rng.lognormal(5.8, 1.1, int(n * 0.9))
    long = rng.pareto(1.2, n - len(short)) * 2000 + 1000
    return np.minimum(np.concatenate([short, long]).astype(np.int64) + 1, 32768)


def main() -> None:
    n = 50_000
    lens = lengths(n)
    rows = []
    for row_len in (2048, 4096, 8192, 16384):
        clipped = np.minimum(lens, row_len)
        t0 = time.perf_counter()
        bins = best_fit_decreasing(clipped, row_len)
        dt = time.perf_counter() - t0
        rows.append({
            "row_len": row_len, "samples": n, "tokens": int(clipped.sum()),
            "bfd_efficiency": round(packing_efficiency(lens, row_len), 4), "bfd_rows": len(bins),
            "pad_to_row_efficiency": round(padding_efficiency(lens, row_len), 4), "pad_to_row_rows": n,
            "pad_to_batch_max_b8": round(padding_efficiency(clipped, batch_size=8), 4),
            "pad_to_batch_max_b32": round(padding_efficiency(clipped, batch_size=32), 4),
            "bfd_seconds": round(dt, 3),
        })
    table(rows, list(rows[0]))
    write_json("packing", {"length_mix": "90% lognormal(5.8, 1.1) + 10% pareto(1.2)*2000+1000, capped 32768",
                           "median_len": int(np.median(lens)), "mean_len": float(lens.mean()), "results": rows})
    if out_dir() is None:
        return
    import matplotlib  # the `bench` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    for k, (key, label) in enumerate([("bfd_efficiency", "BFD packing"), ("pad_to_batch_max_b8", "pad to batch max (b=8)"),
                                      ("pad_to_row_efficiency", "pad to row length")]):
        ax.bar(x + (k - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(x, [str(r["row_len"]) for r in rows])
    ax.set_xlabel("row length (tokens)")
    ax.set_ylabel("real tokens / slots")
    ax.set_title("dataengine packing efficiency, long-tailed mix")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, "dataengine_packing.png")


if __name__ == "__main__":
    main()
