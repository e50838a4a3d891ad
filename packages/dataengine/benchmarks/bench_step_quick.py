# requires: cuda, kvpool
"""Selection and the sparse decode step at b8 x 128K in a few seconds of device time: dense paged
decode (the peer) vs select + sparse decode, every selection path, same run.

Rows (GPU time, CUDA events, L2 flushed, median; `_graph`: CUDA-graph replay), per summary type s:
  dense                    kvpool.paged_decode over all 8192 blocks
  <s>.two[_ring]           select_blocks in two launches (scores, topk_fast_kernel); _ring: the fp8 /
                           int4 scores through per-warp rings (DATAENGINE_RING_SCORES=on; fp8 on f16
                           tensor cores), else the register path (fp8 codes decoded to bf16)
  <s>.two_ring_heads       the same with DATAENGINE_RING_GRID=heads (quest_score_heads_kernel)
  <s>.fused[_ring]         DATAENGINE_SELECT_FUSED=1: one launch of quest_select_chunk_kernel
  <s>.score[_ring] / topk  the two launches apart
  <s>.step_<path>          that selection + sparse paged_decode, and its speedup over dense
  <s>.two_ring_heads_pairs int4 rows: the same with DATAENGINE_RING_Q4=pairs (paired-groups epilogue)
  <s>.<path>_occ3          DATAENGINE_RING_OCC=3 (3 CTAs per SM, one ring stage fewer)
  <s>.two_ring_records[_pairs]  DATAENGINE_RING_GRID=records (a CTA ring of 16 blocks' whole records)
  <s>.<path>_tx / _t512 / _t256  that path with DATAENGINE_TOPK_KERNEL=fastx / fast512 / fast256
  <s>.<path>_h1            fp8: DATAENGINE_RING_FP8=h1 (the high code pairs read as R.H1)
  <s>.default_optin[_occ3] the defaults with fastx and int4 pairs / fp8 h1 only (_occ3: DATAENGINE_RING_OCC=3;
                           fp8 without h1)
  <s>.default              the defaults (no variable set)
  <s>.default_pdl          the defaults with TILESTACK_PDL=1 (programmatic dependent launch of the score,
                           top-k, sparse decode and combine launches)
  <s>.topk_<variant>_us    the top-k launch apart (fast, fastx, fast512, fast256)
BENCH_FLUSH=read times every row after a 256 MiB read instead of tilehal's memset flush (clean L2 lines).
Every path's blocks are compared with the torch reference's (same summaries). BENCH_CONTEXTS
(default 131072) adds shorter contexts (the first blocks of each sequence) for the summaries in
BENCH_CURVE_SUMMARIES (default fp8) and the paths in BENCH_CURVE_PATHS (default "default").
BENCH_PATHS (comma-separated names) limits the paths at the largest context (default: all).
BENCH_DECODE_SPARSE (comma-separated KVPOOL_DECODE_SPARSE values, e.g. gather,gather:1) adds, per summary
type, the sparse decode alone with that kernel (sparse_decode_only_<v>_us[_graph], its calc_diff vs the
default kernel's output) and the default selection + that decode (step_default_<v>_us[_graph],
speedup_default_<v>[_graph]); ':' in a value becomes '_' in the row names. BENCH_DECODE_COMBINE (comma-separated
KVPOOL_DECODE_COMBINE values, e.g. cluster,ticket) adds the same rows as combine_<v>.
Writes dataengine_step_quick.json into $DATAENGINE_BENCH_OUT (or docs/benchmarks with --record).
"""

from __future__ import annotations

import json
import os

import kvpool
import tilehal
import torch
from _common import out_dir, write_json
from bench_select_cuda import BS, HQ, TOP, B, H, build_pool, fp8_summaries, int4_summaries
from dataengine import cuda_select, select
from tilehal.testing import environ

# BENCH_FLUSH: the L2 state before each timed call, tilehal.bench's flush_l2: "write" (default: a 256 MiB
# memset, which leaves the L2 full of dirty lines the timed call's misses write back) or "read" (a 256 MiB
# read: cold and clean, as after a model's weight-streaming GEMMs)
FLUSH = os.environ.get("BENCH_FLUSH") or "write"


def bench(fn) -> float:
    return round(tilehal.bench(fn, warmup=3, iters=20, flush_l2=FLUSH).median_s * 1e6, 2)


def bench_graph(fn):
    try:
        return round(tilehal.bench_graph(fn, warmup=3, iters=20, flush_l2=FLUSH).median_s * 1e6, 2)
    except Exception as e:
        return f"capture failed: {type(e).__name__}: {e}"[:200]


def paths(dtype: torch.dtype) -> list[tuple[str, dict]]:
    """(name, environment) of every selection path for one summary type; "default" sets nothing."""
    rings = ("on", "off") if dtype in (torch.float8_e4m3fn, torch.uint8) else ("off",)
    out = [("default", {}), ("default_pdl", {"TILESTACK_PDL": "1"})]
    for ring in rings:
        sfx = "_ring" if ring == "on" else ""
        base = {"DATAENGINE_RING_SCORES": ring, "DATAENGINE_RING_GRID": "chunk"}
        out.append((f"two{sfx}", {**base, "DATAENGINE_SELECT_FUSED": "0"}))
        if ring == "on":
            out.append(("two_ring_heads", {**base, "DATAENGINE_SELECT_FUSED": "0", "DATAENGINE_RING_GRID": "heads"}))
        out.append((f"fused{sfx}", {**base, "DATAENGINE_SELECT_FUSED": "1"}))
    if dtype in (torch.float8_e4m3fn, torch.uint8):  # the opt-ins of the two-launch ring scores (heads-grid family)
        two = {"DATAENGINE_RING_SCORES": "on", "DATAENGINE_SELECT_FUSED": "0"}
        heads, records = {**two, "DATAENGINE_RING_GRID": "heads"}, {**two, "DATAENGINE_RING_GRID": "records"}
        occ3, pairs = {"DATAENGINE_RING_OCC": "3"}, {"DATAENGINE_RING_Q4": "pairs"}
        if dtype == torch.uint8:
            bases = {"two_ring_heads_pairs": {**heads, **pairs}, "two_ring_heads_pairs_occ3": {**heads, **pairs, **occ3},
                     "two_ring_records": records, "two_ring_records_pairs": {**records, **pairs},
                     "two_ring_records_pairs_occ3": {**records, **pairs, **occ3}}
            topk_on = "two_ring_heads_pairs"
            combos = ("two_ring_heads_pairs_occ3", "two_ring_records_pairs", "two_ring_records_pairs_occ3")
        else:
            h1 = {"DATAENGINE_RING_FP8": "h1"}
            bases = {"two_ring_heads_occ3": {**heads, **occ3}, "two_ring_records": records,
                     "two_ring_heads_h1": {**heads, **h1}, "two_ring_records_h1": {**records, **h1}}
            topk_on = "two_ring_heads"
            combos = ("two_ring_heads_occ3", "two_ring_records", "two_ring_heads_h1", "two_ring_records_h1")
        out += list(bases.items())
        env_of = {**bases, "two_ring_heads": heads}
        for t in ("x", "512", "256"):  # the top-k variants on one score path; fastx on the others too
            out.append((f"{topk_on}_t{t}", {**env_of[topk_on], "DATAENGINE_TOPK_KERNEL": f"fast{t}"}))
        out += [(f"{c}_tx", {**env_of[c], "DATAENGINE_TOPK_KERNEL": "fastx"}) for c in combos]
        # candidate defaults: the variables alone, the rest as select_blocks picks it (one launch for
        # rows of <= 2048 blocks, two at 128K)
        # (fp8: h1 without OCC 3, which spills with it)
        cand = {"DATAENGINE_TOPK_KERNEL": "fastx", **(pairs if dtype == torch.uint8 else {"DATAENGINE_RING_FP8": "h1"})}
        cand3 = {**cand, **occ3} if dtype == torch.uint8 else {"DATAENGINE_TOPK_KERNEL": "fastx", **occ3}
        out += [("default_optin", cand), ("default_optin_occ3", cand3)]
    only = [x for x in os.environ.get("BENCH_PATHS", "").split(",") if x]
    return [(n, e) for n, e in out if not only or n in only]


def main() -> None:
    pool = build_pool()
    bt_full = pool.block_table(list(range(B)))
    kmin, kmax = pool.key_summary(0)
    q = torch.randn(B, HQ, 128, device="cuda", dtype=torch.bfloat16)
    contexts = [int(x) for x in os.environ.get("BENCH_CONTEXTS", "131072").split(",")]
    decoders = [(x.replace(":", "_"), {"KVPOOL_DECODE_SPARSE": x})
                for x in os.environ.get("BENCH_DECODE_SPARSE", "").split(",") if x]
    decoders += [(f"combine_{x}", {"KVPOOL_DECODE_COMBINE": x})
                 for x in os.environ.get("BENCH_DECODE_COMBINE", "").split(",") if x]
    res = {"config": {"batch": B, "q_heads": HQ, "kv_heads": H, "block_size": BS, "top_k": TOP, "sink": 1, "local": 1},
           "timer": f"tilehal.bench: CUDA events, median of 20 after 3 warm-up, L2 flushed ({FLUSH})", "flush": FLUSH,
           "contexts": {}}
    summaries = {"fp8": fp8_summaries(kmin, kmax), "int4": int4_summaries(kmin, kmax), "bf16": (kmin, kmax)}
    for ctx in sorted(contexts, reverse=True):
        nb = ctx // BS
        bt = bt_full[:, :nb].contiguous()
        sl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        dense = lambda bt=bt, sl=sl: kvpool.paged_decode(q, pool, 0, bt, sl)  # noqa: E731
        row = {"dense_us": bench(dense), "dense_graph_us": bench_graph(dense)}
        print(ctx, "dense", row["dense_us"], row["dense_graph_us"], flush=True)
        curve_s = os.environ.get("BENCH_CURVE_SUMMARIES", "fp8").split(",")
        curve_p = os.environ.get("BENCH_CURVE_PATHS", "default").split(",")
        for name, (lo, hi) in summaries.items():
            if ctx != max(contexts) and name not in curve_s:
                continue
            ref = select.select_blocks_reference(q, lo, hi, bt, sl, TOP, 1, 1, block_size=BS)
            sbytes = 2 * B * nb * H * lo.shape[-1] * lo.element_size()
            r = {"summary_bytes": sbytes, "floor_us_at_4TBps": round(sbytes / 4.0e12 * 1e6, 2)}

            def sel(bt=bt, sl=sl, lo=lo, hi=hi):
                return select.select_blocks(q, lo, hi, bt, sl, TOP, 1, 1, block_size=BS)

            def step(bt=bt, sl=sl, sel=sel):
                return kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=sel())

            for pname, env in paths(lo.dtype):
                if ctx != max(contexts) and pname not in curve_p:
                    continue
                with environ(env):
                    try:
                        got = sel()
                    except Exception as e:  # a failed path is a row that says so, not a lost run
                        r[pname] = f"failed: {type(e).__name__}: {e}"[:300]
                        continue
                    r[f"{pname}_equals_reference"] = bool(torch.equal(got, ref))
                    r[f"{pname}_mismatching_rows"] = int((got != ref).any(-1).sum())
                    r[f"select_{pname}_us"] = bench(sel)
                    r[f"select_{pname}_graph_us"] = bench_graph(sel)
                    r[f"select_{pname}_GBps"] = round(sbytes / r[f"select_{pname}_us"] / 1e3)
                    r[f"step_{pname}_us"] = bench(step)
                    r[f"step_{pname}_graph_us"] = bench_graph(step)
                    r[f"speedup_{pname}"] = round(row["dense_us"] / r[f"step_{pname}_us"], 2)
                    g = r[f"step_{pname}_graph_us"]
                    if isinstance(g, float) and isinstance(row["dense_graph_us"], float):
                        r[f"speedup_{pname}_graph"] = round(row["dense_graph_us"] / g, 2)
                    if pname.startswith("two") and ctx == max(contexts):  # the two launches apart
                        t = bench(lambda bt=bt, lo=lo, hi=hi: cuda_select.quest_raw_scores(q, lo, hi, bt, "max"))
                        sname = pname[4:].removesuffix("_tx").removesuffix("_t512").removesuffix("_t256") or "mma"
                        r[f"score_{sname}_us"] = t  # score_mma / score_ring / score_ring_heads[_pairs]
                        raw = cuda_select.quest_raw_scores(q, lo, hi, bt, "max")
                        tv = env.get("DATAENGINE_TOPK_KERNEL", "fast")
                        r[f"topk_{tv}_us"] = bench(lambda raw=raw, sl=sl, tv=tv: cuda_select.topk_rows(
                            raw, TOP, H, 1, 1, seq_lens=sl, block_size=BS, variant=tv))
                print(ctx, name, json.dumps(r), flush=True)  # after every path: a cut run keeps what it measured
            idx = ref

            def sparse_only(bt=bt, sl=sl, idx=idx):
                return kvpool.paged_decode(q, pool, 0, bt, sl, block_indices=idx)

            r["sparse_decode_only_us"] = bench(sparse_only)
            r["sparse_decode_only_graph_us"] = bench_graph(sparse_only)
            base_out = sparse_only()
            for tag, denv in decoders:  # BENCH_DECODE_SPARSE's kernels / BENCH_DECODE_COMBINE's merges, same selection
                with environ(denv):
                    try:
                        got = sparse_only()
                    except Exception as e:
                        r[f"decode_{tag}"] = f"failed: {type(e).__name__}: {e}"[:300]
                        continue
                    r[f"decode_{tag}_calc_diff_vs_default"] = float(f"{tilehal.calc_diff(got, base_out):.2e}")
                    r[f"sparse_decode_only_{tag}_us"] = bench(sparse_only)
                    r[f"sparse_decode_only_{tag}_graph_us"] = bench_graph(sparse_only)
                    if ctx == max(contexts) or name in curve_s:
                        r[f"step_default_{tag}_us"] = bench(step)
                        r[f"step_default_{tag}_graph_us"] = g = bench_graph(step)
                        r[f"speedup_default_{tag}"] = round(row["dense_us"] / r[f"step_default_{tag}_us"], 2)
                        if isinstance(g, float) and isinstance(row["dense_graph_us"], float):
                            r[f"speedup_default_{tag}_graph"] = round(row["dense_graph_us"] / g, 2)
            row[name] = r
            print(ctx, name, json.dumps(r), flush=True)
        res["contexts"][str(ctx)] = row
        print(ctx, "dense", row["dense_us"], row["dense_graph_us"], flush=True)
    if out_dir() is not None:
        write_json("step_quick", res)


if __name__ == "__main__":
    main()
