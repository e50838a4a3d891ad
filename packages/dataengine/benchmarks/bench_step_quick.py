# requires: cuda, kvpool
"""The sparse decode step at b8 x 128K in a few seconds of device time: dense paged decode (the
peer) vs select + sparse decode, default path vs the opt-in variants, same run.

Rows (GPU time, CUDA events, L2 flushed, median; `_graph`: CUDA-graph replay):
  dense                      kvpool.paged_decode over all 8192 blocks
  step_<s>                   select_blocks (default path) + sparse paged_decode, summaries s
  step_<s>_prefetch          the same with KVPOOL_DECODE_PREFETCH=1
  select_<s>_stream          DATAENGINE_SELECT_STREAM=on (quest_select_stream_kernel), and its step
Equality of every variant's blocks with the default path's is printed too. Writes
bench_step_quick.json into $DATAENGINE_BENCH_OUT (or docs/benchmarks with --record). Written
2026-12-02 for a device round that was cancelled: not yet run on a GPU.
"""

from __future__ import annotations

import json

import kvpool
import tilehal
import torch
from _common import out_dir, write_json
from bench_select_cuda import BS, HQ, TOP, B, H, build_pool, fp8_summaries, int4_summaries
from dataengine import select
from tilehal.testing import environ


def bench(fn) -> float:
    return round(tilehal.bench(fn, warmup=3, iters=20, flush_l2=True).median_s * 1e6, 2)


def bench_graph(fn):
    try:
        return round(tilehal.bench_graph(fn, warmup=3, iters=20, flush_l2=True).median_s * 1e6, 2)
    except Exception as e:
        return f"capture failed: {type(e).__name__}: {e}"[:200]


def main() -> None:
    pool = build_pool()
    bt = pool.block_table(list(range(B)))
    sl = pool.seq_lens(list(range(B)))
    kmin, kmax = pool.key_summary(0)
    q = torch.randn(B, HQ, 128, device="cuda", dtype=torch.bfloat16)
    res = {"config": {"batch": B, "q_heads": HQ, "kv_heads": H, "context": int(sl[0]), "top_k": TOP}}
    dense = lambda: kvpool.paged_decode(q, pool, 0, bt, sl)  # noqa: E731
    res["dense_us"], res["dense_graph_us"] = bench(dense), bench_graph(dense)
    for name, (lo, hi) in (("fp8", fp8_summaries(kmin, kmax)), ("int4", int4_summaries(kmin, kmax))):
        def sel(lo=lo, hi=hi):
            return select.select_blocks(q, lo, hi, bt, sl, TOP, 1, 1, block_size=BS)

        def step(sel=sel):
            return kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=sel())

        want, out = sel(), step()
        r = {"select_us": bench(sel), "step_us": bench(step), "step_graph_us": bench_graph(step)}
        with environ({"KVPOOL_DECODE_PREFETCH": "1"}):
            r["prefetch_equal"] = bool(torch.equal(step(), out))
            r["step_prefetch_us"], r["step_prefetch_graph_us"] = bench(step), bench_graph(step)
        with environ({"DATAENGINE_SELECT_STREAM": "on"}):
            r["stream_equals_default_rows"] = float((sel() == want).all(-1).float().mean())
            r["select_stream_us"], r["select_stream_graph_us"] = bench(sel), bench_graph(sel)
            r["step_stream_us"] = bench(step)
            with environ({"KVPOOL_DECODE_PREFETCH": "1"}):
                r["step_stream_prefetch_us"], r["step_stream_prefetch_graph_us"] = bench(step), bench_graph(step)
        for k in [k for k in r if k.startswith("step") and k.endswith("_us")]:
            g = "dense_graph_us" if "graph" in k else "dense_us"
            if isinstance(r[k], float) and isinstance(res[g], float):
                r["speedup_" + k[:-3]] = round(res[g] / r[k], 2)
        res[name] = r
        print(name, json.dumps(r), flush=True)
    print("dense", res["dense_us"], res["dense_graph_us"])
    if out_dir() is not None:
        write_json("step_quick", res)


if __name__ == "__main__":
    main()
