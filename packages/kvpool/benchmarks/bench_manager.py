"""Block manager throughput on the CPU (pure Python bookkeeping, no K/V traffic).

1. append + free: sequences grow by `append(seq, n)` (blocks allocated) and are freed; we
   report blocks allocated and freed per second for decode-like (1 block per call) and
   prefill-like (64 blocks per call) patterns. The same for the BlockManager alone (no slot
   tensors), with plain and LRU-evicting (prefix-cached) blocks.
2. add_sequence on a 32K-token prompt whose prefix is cached (2047 of 2048 blocks hit):
   hashing and matching cost per call.
With --record, writes docs/benchmarks/kvpool_manager.json. No peer library is installed here (vLLM's block
pool lives inside vLLM), so figures stand alone against the issue's 200k/s target.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import kvpool
import torch
from kvpool.block_manager import BlockManager

try:
    from tqdm import tqdm
except ImportError:
    def tqdm(it, **_):
        return it

OUT_DIR = Path(__file__).resolve().parents[3] / "docs" / "benchmarks"
BS = 16


def tiny_pool(num_blocks: int, prefix_caching: bool = True) -> kvpool.KVPool:
    return kvpool.KVPool(1, 1, 8, num_blocks, block_size=BS, dtype=torch.float32, prefix_caching=prefix_caching,
                         watermark=0.0, debug=False)


def append_free(blocks_per_call: int, calls_per_seq: int, rounds: int) -> dict:
    seqs = 64
    pool = tiny_pool(seqs * (blocks_per_call * calls_per_seq + 1) + 16)
    t0 = time.perf_counter()
    blocks = 0
    for r in tqdm(range(rounds), desc=f"append {blocks_per_call} blocks/call", leave=False):
        for s in range(seqs):
            pool.add_sequence((r, s), [s])
            pool.append((r, s), 1)  # the prompt token (fills the partial block)
            for _ in range(calls_per_seq):
                pool.append((r, s), BS * blocks_per_call)
            blocks += len(pool.blocks_of((r, s)))
        for s in range(seqs):
            pool.free((r, s))
    dt = time.perf_counter() - t0
    return {"pattern": f"KVPool.append+free, {blocks_per_call} block(s) per append", "blocks": blocks, "seconds": dt,
            "block_allocs_plus_frees_per_s": blocks / dt, "append_calls_per_s": rounds * seqs * calls_per_seq / dt}


def append_batch_free(steps: int, rounds: int) -> dict:
    """A decode-style engine loop: every step one `append_batch` over 64 sequences (1 block each)."""
    seqs = 64
    pool = tiny_pool(seqs * (steps + 1) + 16)
    t0 = time.perf_counter()
    blocks = 0
    for r in tqdm(range(rounds), desc="append_batch", leave=False):
        ids = [(r, s) for s in range(seqs)]
        for sid in ids:
            pool.add_sequence(sid, [0])
        pool.append_batch(ids, 1)
        for _ in range(steps):
            pool.append_batch(ids, BS)
        blocks += sum(len(pool.blocks_of(sid)) for sid in ids)
        for sid in ids:
            pool.free(sid)
    dt = time.perf_counter() - t0
    return {"pattern": "KVPool.append_batch(64 seqs x 1 block)+free", "blocks": blocks, "seconds": dt,
            "block_allocs_plus_frees_per_s": blocks / dt}


def manager_only(blocks_per_op: int, cached: bool, rounds: int = 20000) -> dict:
    """The BlockManager alone (what KVPool.append/free sit on): allocate + release, no tensors.

    cached=True registers a hash on every block before releasing it, so allocations come from
    the LRU list and evict (unlink + hash drop), the prefix-caching steady state.
    """
    mgr = BlockManager(blocks_per_op * 4)
    n = 0
    t0 = time.perf_counter()
    for r in range(rounds):
        got = mgr.allocate(blocks_per_op)
        if cached:
            for i, b in enumerate(got):
                mgr.register(b, (r * blocks_per_op + i).to_bytes(8, "little"))
        for b in reversed(got):
            mgr.decref(b)
        n += blocks_per_op
    dt = time.perf_counter() - t0
    return {"pattern": f"BlockManager, {blocks_per_op} block(s)/op, {'LRU-evicting' if cached else 'plain'}",
            "blocks": n, "seconds": dt, "block_allocs_plus_frees_per_s": n / dt}


def prefix_match(prompt_len: int = 32768, iters: int = 20) -> dict:
    pool = tiny_pool(2 * prompt_len // BS + 16)
    prompt = list(range(prompt_len))
    pool.add_sequence("base", prompt)
    pool.append("base", prompt_len)
    times, hit = [], 0
    for i in range(iters):
        t0 = time.perf_counter()
        hit = pool.add_sequence(i, prompt)
        times.append(time.perf_counter() - t0)
        pool.free(i)
    times.sort()
    return {"prompt_tokens": prompt_len, "hit_tokens": hit, "median_ms": times[len(times) // 2] * 1e3,
            "min_ms": times[0] * 1e3, "tokens_per_s": prompt_len / times[len(times) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true", help="write the results into docs/benchmarks/ (default: print only)")
    ap.add_argument("--out", type=Path, default=None, help="write the results into this folder instead")
    args = ap.parse_args()
    rows = [append_free(1, 16, 40), append_batch_free(16, 40), append_free(64, 1, 40)]
    rows += [manager_only(1, False), manager_only(1, True), manager_only(64, False, 2000), manager_only(64, True, 2000)]
    pm = prefix_match()
    print(f"{'pattern':<52}{'blocks alloc+free /s':>22}{'append calls /s':>18}")
    for r in rows:
        calls = f"{r['append_calls_per_s']:>18,.0f}" if "append_calls_per_s" in r else f"{'-':>18}"
        print(f"{r['pattern']:<52}{r['block_allocs_plus_frees_per_s']:>22,.0f}{calls}")
    print(f"add_sequence, 32K-token prompt, {pm['hit_tokens']} tokens hit: {pm['median_ms']:.2f} ms median")
    result = {"benchmark": "kvpool block manager", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                          "host": platform.node()},
              "append_free": rows, "prefix_match_32k": pm}
    if args.out is None and not args.record:
        print("not recorded (pass --record to write docs/benchmarks/kvpool_manager.json)")
        return
    args.out = args.out or OUT_DIR
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kvpool_manager.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'kvpool_manager.json'}")


if __name__ == "__main__":
    main()
