# requires: cuda, kvpool
"""What the b8 x 128K sparse decode step's time is made of (issue 15): int4 summaries, default selection.

  --times (default)  every piece (score launch, top-k launch, selection, sparse decode, the step, dense) timed
                     with CUDA events under four L2 states before each call: "zero" (tilehal.bench's flush:
                     a 256 MiB memset, which leaves the L2 full of dirty lines the timed kernel must write
                     back), "read" (a 256 MiB read: the L2 cold and clean), "zero+read" (both: the dirt
                     written back before the timed call), "none" (warm); a floor (one and two empty launches);
                     the sparse decode at split counts 1..8 with the combine launch and the in-kernel ticket
                     merge; the decode over four layouts of the same 64 blocks (random / contiguous, per
                     head / shared by the heads); TILESTACK_PDL=1 (programmatic dependent launch) vs plain launches, eager and CUDA
                     graph; a torch.profiler (CUPTI) trace of the step: each kernel's duration and the gaps.
  --ncu clean|dirty  one step between cudaProfilerStart / Stop, for `ncu --profile-from-start off`; "dirty"
                     runs the 256 MiB memset before it (use with `ncu --cache-control none`), "clean" also
                     the sparse decode at 1 and 2 splits.
Writes dataengine_profile_step.json into $DATAENGINE_BENCH_OUT (or docs/benchmarks with --record).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import kvpool
import tilehal
import torch
from _common import out_dir, write_json
from bench_select_cuda import BS, HQ, TOP, B, build_pool, int4_summaries
from dataengine import cuda_select, select
from kvpool import cuda_decode
from tilehal.testing import environ

CTX = 131072
FLUSH_BYTES = 256 * 2**20
FLUSHES = ("zero", "read", "zero+read", "none")
_W = _R = None


def _flush(mode: str) -> None:
    global _W, _R
    if _W is None:
        _W = torch.zeros(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        _R = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")  # (an int32 sum widens to int64 first)
    if mode in ("zero", "zero+read"):
        _W.zero_()
    if mode in ("read", "zero+read"):
        _R.sum()  # reads 256 MiB, writes 4 bytes: the L2 ends up holding clean lines of _R


def timed(fn, flush: str, iters: int = 20, warmup: int = 3) -> dict:
    """GPU time of fn() (median / p20 / p80 us over `iters`): tilehal.bench's scheme (a sleep kernel ahead of
    the start event hides the host's launch work) with the L2 state `flush` before each call."""
    host = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    est = statistics.median(host)
    ts = []
    for _ in range(iters):
        _flush(flush)
        torch.cuda._sleep(int((2 * est + 20e-6) * 2e9))
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    ts.sort()
    return {"us": round(statistics.median(ts), 2), "p20": round(ts[len(ts) // 5], 2),
            "p80": round(ts[(4 * len(ts)) // 5], 2)}


def setup():
    pool = build_pool()
    bt = pool.block_table(list(range(B)))[:, :CTX // BS].contiguous()
    kmin, kmax = pool.key_summary(0)
    lo, hi = int4_summaries(kmin, kmax)
    sl = torch.full((B,), CTX, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, 128, device="cuda", dtype=torch.bfloat16)
    return pool, bt, lo, hi, sl, q


def pieces(pool, bt, lo, hi, sl, q):
    H = lo.shape[1]
    ref = select.select_blocks_reference(q, lo, hi, bt, sl, TOP, 1, 1, block_size=BS)
    raw = cuda_select.quest_raw_scores(q, lo, hi, bt, "max")

    def sel():
        return select.select_blocks(q, lo, hi, bt, sl, TOP, 1, 1, block_size=BS)

    def decode(idx=ref, splits=None):
        return cuda_decode.paged_decode_cuda(q, pool, 0, bt, sl, None, idx, num_splits=splits)

    return {
        "score": lambda: cuda_select.quest_raw_scores(q, lo, hi, bt, "max"),
        "topk": lambda: cuda_select.topk_rows(raw, TOP, H, 1, 1, seq_lens=sl, block_size=BS),
        "select": sel,
        "sparse_decode": lambda: kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=ref),
        "step": lambda: kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=sel()),
        "dense": lambda: kvpool.paged_decode(q, pool, 0, bt, sl),
    }, ref, decode, sel


def trace(fn, flush: str, n: int = 8) -> dict:
    """CUPTI kernel records of n calls of fn (after `flush` and a sleep each): per call the kernels in order
    with their durations and the gaps between them (us)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            _flush(flush)
            torch.cuda._sleep(int(60e-6 * 2e9))
            fn()
        torch.cuda.synchronize()
    path = f"/tmp/profile_step_trace_{flush.replace('+', '_')}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    evs.sort(key=lambda e: e["ts"])
    calls, cur = [], None
    for e in evs:
        name = e["name"]
        if "spin_kernel" in name or "sleep" in name.lower():  # torch.cuda._sleep's kernel precedes each call
            cur = []
            calls.append(cur)
            continue
        if cur is None or "reduce_kernel" in name or "FillFunctor" in name:  # the flush's kernels
            continue
        cur.append(e)
    out = []
    for c in calls:
        if not c:
            continue
        t0 = c[0]["ts"]
        out.append({"span_us": round(c[-1]["ts"] + c[-1]["dur"] - t0, 2),
                    "kernels": [(short(e["name"]), round(e["ts"] - t0, 2), round(e["dur"], 2)) for e in c]})
    return {"calls": out}


def short(name: str) -> str:
    for key in ("records", "heads", "topk", "paged_decode_mma", "paged_decode_combine", "paged_decode_gather",
                "quest", "paged_decode"):
        if key in name:
            return name.split("<")[0].split("::")[-1][:48]
    return name[:48]


def summarize(t: dict) -> dict:
    """Median over calls of each kernel position's duration, start and the span."""
    calls = t["calls"]
    if not calls:
        return {}
    n = statistics.mode(len(c["kernels"]) for c in calls)
    same = [c for c in calls if len(c["kernels"]) == n]
    rows = []
    for i in range(n):
        rows.append({"kernel": same[0]["kernels"][i][0],
                     "start_us": round(statistics.median(c["kernels"][i][1] for c in same), 2),
                     "dur_us": round(statistics.median(c["kernels"][i][2] for c in same), 2)})
    return {"span_us": round(statistics.median(c["span_us"] for c in same), 2), "kernels": rows, "calls": len(same)}


def main_times() -> None:
    pool, bt, lo, hi, sl, q = setup()
    fns, ref, decode, sel = pieces(pool, bt, lo, hi, sl, q)
    got = sel()
    res = {"config": {"batch": B, "context": CTX, "summaries": "int4", "top_k": TOP, "block_size": BS},
           "default_equals_reference": bool(torch.equal(got, ref)), "flush_bytes": FLUSH_BYTES}
    print("default selection == reference:", res["default_equals_reference"], flush=True)
    one = torch.zeros(1, device="cuda")
    fns_floor = {"floor_1_launch": lambda: one.add_(1), "floor_2_launches": lambda: (one.add_(1), one.add_(1))}
    rows = {}
    for name, fn in {**fns_floor, **fns}.items():
        rows[name] = {}
        for fl in FLUSHES:
            if name == "dense" and fl == "none":
                continue
            try:
                rows[name][fl] = timed(fn, fl)
            except Exception as e:  # a failed row says so; the rest still runs
                rows[name][fl] = f"failed: {type(e).__name__}: {e}"[:200]
        print(name, json.dumps(rows[name]), flush=True)
    res["times"] = rows
    # the sparse decode's split count and merge
    base = decode()
    plan = cuda_decode._launch_plan(pool.dtype, 128, HQ // lo.shape[1], cuda_decode.default_config(), BS, B,
                                    lo.shape[1], TOP, q.device.index or 0, None, cuda_decode.SPARSE_MIN_TILES)
    res["default_splits"] = plan[3]
    print("default sparse splits:", plan[3], flush=True)
    sweep = {}
    for comb in ("launch", "ticket"):
        for s in (1, 2, 3, 4, 6, 8):
            if s == 1 and comb == "ticket":  # one split never merges: its row would repeat launch's
                continue
            tag = f"s{s}_{comb}"
            with environ({"KVPOOL_DECODE_COMBINE": comb}):
                try:
                    out = decode(splits=s)
                    r = {"calc_diff_vs_default": float(f"{tilehal.calc_diff(out, base):.2e}")}
                    for fl in ("zero", "read"):
                        r[fl] = timed(lambda s=s: decode(splits=s), fl)["us"]
                        r[f"step_{fl}"] = timed(lambda s=s: decode(idx=sel(), splits=s), fl)["us"]
                except Exception as e:
                    r = f"failed: {type(e).__name__}: {e}"[:200]
            sweep[tag] = r
            print("split", tag, json.dumps(r), flush=True)
    res["splits"] = sweep
    # what bounds the decode's reads: the same 64 blocks per (sequence, kv head) laid out four ways. A (block,
    # head) is 16 rows of 256 B at a 2 KB stride (the pool is [block, token, head, dim]); 64 logical blocks
    # from a multiple of 64 are one physical run in this pool (contiguous_physical says whether).
    lay = {}
    try:
        H = lo.shape[1]
        ar = torch.arange(64, device="cuda", dtype=torch.int32)
        run = bt[:, 1024:1088]
        lay["contiguous_physical"] = bool(((run[:, 1:] - run[:, :-1]) == 1).all())
        layouts = {"real": ref,
                   "random_same_for_all_heads": ref[:, :1].expand(-1, H, -1).contiguous(),
                   "contig_same_for_all_heads": (1024 + ar).expand(B, H, -1).contiguous(),
                   "contig_per_head": (1024 + 64 * torch.arange(H, device="cuda", dtype=torch.int32)[:, None]
                                       + ar).expand(B, -1, -1).contiguous()}
        for name, idx in layouts.items():
            lay[name] = {fl: timed(lambda idx=idx: decode(idx=idx), fl)["us"] for fl in ("zero", "read")}
    except Exception as e:
        lay["failed"] = f"{type(e).__name__}: {e}"[:300]
    res["layouts"] = lay
    print("layouts", json.dumps(lay), flush=True)
    for fl in ("zero", "read"):
        for name in ("step", "sparse_decode"):
            try:
                t = summarize(trace(fns[name], fl))
            except Exception as e:
                t = f"failed: {type(e).__name__}: {e}"[:300]
            res[f"trace_{name}_{fl}"] = t
            print("trace", name, fl, json.dumps(t), flush=True)
    d = res["times"]["dense"]
    for fl in ("zero", "read", "zero+read"):
        try:
            res[f"speedup_step_{fl}"] = round(d[fl]["us"] / res["times"]["step"][fl]["us"], 2)
        except (KeyError, TypeError):
            pass
    print("speedups:", {k: v for k, v in res.items() if k.startswith("speedup")}, flush=True)
    if out_dir() is not None:  # written now and again after the PDL rows (a failure there keeps these)
        write_json("profile_step", res)
    # TILESTACK_PDL=1 (programmatic dependent launch of the score, top-k, decode and combine launches)
    pdl = {}
    with environ({"TILESTACK_PDL": "1"}):
        try:
            pdl["equals_reference"] = bool(torch.equal(sel(), ref))
            pdl["decode_equals_plain"] = bool(torch.equal(fns["sparse_decode"](), base))
            for name in ("select", "sparse_decode", "step"):
                for fl in ("zero", "read"):
                    pdl[f"{name}_{fl}"] = timed(fns[name], fl)["us"]
            for fl in ("write", "read"):
                pdl[f"step_graph_{fl}"] = round(tilehal.bench_graph(fns["step"], flush_l2=fl).median_us, 2)
        except Exception as e:
            pdl["failed"] = f"{type(e).__name__}: {e}"[:300]
    try:
        for fl in ("write", "read"):
            pdl[f"plain_step_graph_{fl}"] = round(tilehal.bench_graph(fns["step"], flush_l2=fl).median_us, 2)
            pdl[f"plain_dense_graph_{fl}"] = round(tilehal.bench_graph(fns["dense"], flush_l2=fl).median_us, 2)
    except Exception as e:
        pdl["plain_graph_failed"] = f"{type(e).__name__}: {e}"[:300]
    res["pdl"] = pdl
    print("pdl", json.dumps(pdl), flush=True)
    if out_dir() is not None:
        write_json("profile_step", res)


def main_ncu(mode: str) -> None:
    pool, bt, lo, hi, sl, q = setup()
    fns, ref, decode, sel = pieces(pool, bt, lo, hi, sl, q)
    for _ in range(3):
        fns["step"]()
        decode(splits=1)
        decode(splits=2)
    _flush("zero")
    torch.cuda.synchronize()
    if mode == "dirty":
        _flush("zero")
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fns["step"]()
    if mode == "clean":
        decode(splits=1)
        decode(splits=2)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("ncu", mode, "done", flush=True)


if __name__ == "__main__":
    if "--ncu" in sys.argv:
        main_ncu(sys.argv[sys.argv.index("--ncu") + 1])
    else:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        main_times()
