"""Loader throughput: streaming with lazy filtering + domain-mixture sampling vs load-everything-then-filter.

The job: deliver a token budget of samples that pass two filters (length >= 32, 3-gram repetition
<= 0.3) drawn from three domains in a 0.5/0.3/0.2 mixture, from a corpus ~10x the budget on disk.
Naive: read every shard, split into samples, score them all, filter, then sample the mixture.
Ours: StreamingDataset draws candidates in mixture order and reads/scores only those.
Both run on the same files (already in the OS page cache for both, so disk speed is not measured).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import table, write_json
from dataengine.data import (
    Filter,
    LengthScorer,
    NGramRepetitionScorer,
    PackCollate,
    ResumableLoader,
    ShardWriter,
    StreamingDataset,
    TokenDataset,
)
from tqdm.auto import tqdm

WEIGHTS = [0.5, 0.3, 0.2]


def make_corpus(root: Path, num_tokens: int, seed: int = 0) -> TokenDataset:
    rng = np.random.default_rng(seed)
    written = 0
    with ShardWriter(root, domains=("web", "code", "books"), shard_tokens=1 << 22) as w, \
            tqdm(total=num_tokens, desc="writing corpus", unit="tok", unit_scale=True) as bar:
        while written < num_tokens:
            n = int(min(rng.lognormal(5.5, 1.0) + 1, 8192))
            s = rng.integers(0, 50000, n)
            if rng.random() < 0.25:  # boilerplate loops fail the repetition filter
                s = np.tile(s[:8], n // 8 + 1)[:n]
            w.add(s, int(rng.choice(3, p=[0.6, 0.25, 0.15])))
            written += n
            bar.update(n)
    return TokenDataset(root)


def filters():
    return [Filter(LengthScorer(), min_score=32), Filter(NGramRepetitionScorer(3), max_score=0.3)]


def naive(root: Path, budget: int, seed: int) -> int:
    ds = TokenDataset(root)  # only for the file list; everything is read eagerly below
    samples, domains = [], []
    for name in ds.shard_names:
        tokens = np.fromfile(root / f"{name}.tokens", dtype=ds.dtype)
        offsets = np.fromfile(root / f"{name}.offsets", dtype=np.int64)
        domains.append(np.fromfile(root / f"{name}.domains", dtype=np.int16))
        samples += [tokens[offsets[i]:offsets[i + 1]].astype(np.int64) for i in range(len(offsets) - 1)]
    domains = np.concatenate(domains)
    fs = filters()
    keep = np.array([all(f.accepts(f.scorer(s)) for f in fs) for s in samples])
    pools = [np.flatnonzero(keep & (domains == d)) for d in range(3)]
    rng = np.random.default_rng(seed)
    got = 0
    while got < budget:
        d = rng.choice(3, p=WEIGHTS)
        got += len(samples[int(rng.choice(pools[d]))])
    return got


def streaming(root: Path, budget: int, seed: int, batch_size: int = 0, workers: int = 0, pack_len: int = 0) -> int:
    stream = StreamingDataset(TokenDataset(root), seed=seed, domain_weights=WEIGHTS, filters=filters())
    got = 0
    if batch_size == 0:
        for s in stream:
            got += len(s["tokens"])
            if got >= budget:
                break
        return got
    collate = PackCollate(pack_len) if pack_len else None
    for batch in ResumableLoader(stream, batch_size=batch_size, num_workers=workers, collate_fn=collate):
        got += int(batch["lengths"].sum()) if "lengths" in batch else int((batch["doc_ids"] >= 0).sum())
        if got >= budget:
            break
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus-tokens", type=int, default=60_000_000)
    ap.add_argument("--budget", type=int, default=6_000_000)
    ap.add_argument("--record", action="store_true", help="write docs/benchmarks/dataengine_loader.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "corpus"
        ds = make_corpus(root, args.corpus_tokens)
        rows = []
        for name, fn in [("naive load-all-then-filter", lambda: naive(root, args.budget, 0)),
                         ("streaming (iterator)", lambda: streaming(root, args.budget, 0)),
                         ("streaming + DataLoader b=16, pad collate", lambda: streaming(root, args.budget, 0, 16, 0)),
                         ("streaming + DataLoader b=16, pack collate 8192",
                          lambda: streaming(root, args.budget, 0, 16, 0, 8192)),
                         ("streaming + DataLoader b=16, pad, 2 workers",
                          lambda: streaming(root, args.budget, 0, 16, 2))]:
            t0 = time.perf_counter()
            tokens = fn()
            dt = time.perf_counter() - t0
            rows.append({"method": name, "tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt)})
        base = rows[0]["tokens_per_s"]
        for r in rows:
            r["speedup_vs_naive"] = round(r["tokens_per_s"] / base, 2)
        table(rows, ["method", "tokens", "seconds", "tokens_per_s", "speedup_vs_naive"])
        write_json("loader", {"corpus_tokens": ds.num_tokens, "corpus_samples": len(ds), "budget_tokens": args.budget,
                              "weights": WEIGHTS, "filters": "length>=32, 3-gram repetition<=0.3",
                              "note": "files in the OS page cache for every method; 2-core CPU machine",
                              "results": rows})


if __name__ == "__main__":
    main()
