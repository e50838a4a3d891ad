# requires: cuda
"""deepgemm's m-grouped fp8 GEMMs (contiguous and masked) on one H200, kernel variants side by side.

Contiguous: the issue-19 shapes (4 x 8192 rows at N, K = 4096, 7168; 8 x 4096 at 7168, 2048) and the two
Mixtral-8x7B MoE GEMMs of bench_models' MoE row (8 experts, the 9216-row static layout of 4096 tokens x
top-2: gate|up N = 28672, K = 4096; down N = 4096, K = 14336). Each is timed with the heuristic's kernel
and with the variants given by --variants:
  serial        the serial promotion (wait_group 0 per K block), math warps walk the schedule (before s26 R3)
  overlap_lean  overlapped promotion, 24-register producer, 240-register math warpgroups
  overlap_wide  overlapped promotion, 40 / 232 registers (ptxas spills 12 bytes)
  info          the producer hands each tile's coordinates to the math warps through shared memory
                (DEEPGEMM_TILE_INFO=1: no m_indices load in the math warps), serial promotion
  info_overlap  the same with the overlapped promotion, 24-register producer / 240-register math warpgroups
                (no spills): the heuristic's default since s26 R3 (called info_overlap_lean in that run's JSON)
  info_overlap_wide  the same with the 40 / 232 split (28 B of benign spills; R3's info_overlap)
  mcast         2-CTA clusters sharing the A tile (neighbouring n-blocks), grid capped at the clusters the driver
                keeps resident at once (cuOccupancyMaxActiveClusters)
  mcast_uncapped  the same launched on every SM (what multicast did before: the clusters that do not fit wait)
  mcast_release_cluster  mcast with the consumers' remote release as .release.cluster (before: the default
                is a plain remote arrival, as CUTLASS's)
  (s27, opt-in, not timed yet: each on top of the default info_overlap kernel)
  mcast_info    2-CTA A multicast with the producer-fed schedule + overlapped promotion (the R3 mcast row had
                neither: it halves A's L2 reads where the default is L2-throughput-bound)
  expert        expert-major raster: one expert's m-blocks walked together, whole rows of n-blocks (A read from
                DRAM once; the expert's B panel is what the running CTAs share); padding blocks take no units
  expert16      the same in bands of 16 n-blocks inside an expert (wide N: the B band stays in L2)
  expert_mcast  expert-major raster (bands of 8 n-block pairs) + mcast_info
Masked variants (--masked-variants): default, info, mcast, mcast_b and (s27, opt-in) tma (whole m-blocks by TMA
store), tma_info (the same with the producer-fed schedule), bn96 / bn112 (narrower tiles for the (7168, 2048)
wave tail), cursor (MaskedWalk instead of the scan from group 0).
Every variant's output is compared with the first variant's (calc_diff). SwiGLU: the MoE gate|up step
unfused (GEMM -> [M, 2F] bf16 -> silu_mul_cast_to_fp8) vs fused (SwiGLU-epilogue GEMM -> [M, F] bf16 ->
per_token_cast_to_fp8), each timed as a whole and GEMM alone. Masked: 1 x 1024, 2 x 512,
4 x 256 at both (N, K), all groups full. Peer: one per-row torch._scaled_mm per group.
Timing: tilehal.bench (CUDA events, L2 flushed, median of 30) and a CUDA-graph replay.

    python packages/deepgemm/benchmarks/bench_grouped.py [--variants serial,overlap_lean] [--out FILE.json]
    python packages/deepgemm/benchmarks/bench_grouped.py --compile   # NVRTC only, no GPU (warm the cache)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from deepgemm import cuda_gemm
from deepgemm.heuristics import epilogue_bytes, expert_raster_config, max_stages, pick_config, swiglu_config
from deepgemm.utils import ceil_div

CONTIGUOUS = [(4, 8192, 4096, 7168), (8, 4096, 7168, 2048), (8, 1152, 28672, 4096), (8, 1152, 4096, 14336)]
MASKED = [(g, m, n, k) for n, k in ((4096, 7168), (7168, 2048)) for g, m in ((1, 1024), (2, 512), (4, 256))]
VARIANTS = {
    "serial": (dict(tile_info=False, contiguous_overlap=False), ()),
    "overlap_lean": (dict(tile_info=False, contiguous_overlap=True), ()),
    "overlap_wide": (dict(tile_info=False, contiguous_overlap=True), ("-DDEEPGEMM_CONTIG_LEAN_PRODUCER=0",)),
    "info": (dict(tile_info=True, contiguous_overlap=False, allow_overlap=False), ()),
    "info_overlap": (dict(tile_info=True, contiguous_overlap=True), ()),
    "info_overlap_wide": (dict(tile_info=True, contiguous_overlap=True), ("-DDEEPGEMM_CONTIG_LEAN_PRODUCER=0",)),
    "mcast": (dict(multicast=2, multicast_on_a=True), ()),
    "mcast_uncapped": (dict(multicast=2, multicast_on_a=True), ()),
    "mcast_release_cluster": (dict(multicast=2, multicast_on_a=True), ("-DDEEPGEMM_MCAST_RELEASE_CLUSTER=1",)),
    "mcast_info": (dict(multicast=2, multicast_on_a=True, tile_info=True), ()),
    "expert": (lambda cfg: expert_raster_config(cfg, 0), ()),
    "expert16": (lambda cfg: expert_raster_config(cfg, 16), ()),
    "expert_mcast": (lambda cfg: expert_raster_config(
        dataclasses.replace(cfg, multicast=2, multicast_on_a=True, tile_info=True), 8), ()),
}
MASKED_VARIANTS = {"default": (dict(tile_info=False), ()), "info": (dict(tile_info=True), ()),
                   "mcast": (dict(multicast=2, multicast_on_a=True), ()),
                   "mcast_b": (dict(multicast=2, multicast_on_a=False), ()),  # pairs of m-blocks share B
                   # s27, opt-in, not timed yet: whole blocks by TMA store (a group's partial last block copied out
                   # of the staging tile), with / without the producer-fed schedule; other tile widths for the
                   # (7168, 2048) wave tail (448 tiles of 128: 3.4 waves; 96 -> 600 tiles, 112 -> 512); the cursor walk
                   "tma": (lambda g, m, n, k: _masked_pick(g, m, n, k, tma_store=True), ()),
                   "tma_info": (lambda g, m, n, k: dataclasses.replace(_masked_pick(g, m, n, k, tma_store=True),
                                                                       tile_info=True), ()),
                   "bn96": (lambda g, m, n, k: _masked_width(g, m, n, k, 96), ()),
                   "bn112": (lambda g, m, n, k: _masked_width(g, m, n, k, 112), ()),
                   "cursor": (dict(tile_info=False), ("-DDEEPGEMM_MASKED_CURSOR=1",))}
SWIGLU = (8, 1152, 28672, 4096)  # Mixtral's gate|up GEMM on the 9216-row layout
SMS = 132


def contiguous_config(g, rows, n, k, variant, num_sms=SMS):
    cfg = pick_config("fp8", g * rows, n, k, num_groups=g, grouping="contiguous", num_sms=num_sms, tma_store=True)
    fields, opts = VARIANTS[variant]
    return (fields(cfg) if callable(fields) else dataclasses.replace(cfg, **fields)), opts


def masked_config(g, m, n, k, num_sms=SMS):
    return pick_config("fp8", m, n, k, num_groups=g, grouping="masked", num_sms=num_sms,
                       staged_store=cuda_gemm.staged_store(torch.bfloat16, n, False, False))


def _masked_pick(g, m, n, k, tma_store):
    return pick_config("fp8", m, n, k, num_groups=g, grouping="masked", num_sms=SMS, tma_store=tma_store)


def _masked_width(g, m, n, k, bn):
    cfg = masked_config(g, m, n, k)
    return dataclasses.replace(cfg, block_n=bn, stages=max_stages("fp8", cfg.block_m, bn, epilogue_bytes(
        cfg.block_m, bn, False, cfg.staged_store), grouped=True))


def masked_variant(g, m, n, k, variant):
    fields, opts = MASKED_VARIANTS[variant]
    cfg = fields(g, m, n, k) if callable(fields) else dataclasses.replace(masked_config(g, m, n, k), **fields)
    return cfg, opts


def _compile(job):
    key, opts = job
    cuda_gemm.compile_kernel(key, opts)
    return key.expression


def compile_all(variants, jobs=4) -> None:
    work = []
    for g, rows, n, k in CONTIGUOUS:
        for v in variants:
            cfg, opts = contiguous_config(g, rows, n, k, v)
            work.append((cuda_gemm.kernel_key(cfg, n, k, "contiguous", g, torch.bfloat16, False), opts))
    for g, m, n, k in MASKED:
        for v in MASKED_VARIANTS:
            cfg, opts = masked_variant(g, m, n, k, v)
            work.append((cuda_gemm.kernel_key(cfg, n, k, "masked", g, torch.bfloat16, False), opts))
    g, rows, n, k = SWIGLU
    cfg = swiglu_config(contiguous_config(g, rows, n, k, "serial")[0], g * rows, n)
    work.append((cuda_gemm.kernel_key(cfg, n, k, "contiguous", g, torch.bfloat16, False), ()))
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(jobs) as pool:
        for e in pool.map(_compile, work):
            print("compiled", e[:120], flush=True)
    print(f"# compiled {len(work)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)


def _weights(g, n, k):
    import deepgemm

    b8 = torch.empty(g, n, k, device="cuda", dtype=torch.float8_e4m3fn)
    sfb = torch.empty(g, ceil_div(n, 128), ceil_div(k, 128), device="cuda")
    for i in range(g):
        b8[i], sfb[i] = deepgemm.per_block_cast_to_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    return b8, sfb


ONCE = False  # --once: one launch per variant (for ncu), no timing


def _times(fn):
    import tilehal

    fn()
    if ONCE:
        torch.cuda.synchronize()
        return float("nan"), float("nan")
    torch.cuda.synchronize()
    t = tilehal.bench(fn, warmup=5, iters=30, flush_l2=True).median_s
    tg = tilehal.bench_graph(fn, warmup=3, iters=30, flush_l2=True).median_s
    return t, tg


ROUNDS = 1  # --rounds: each shape's variants timed this many times, every other round in reverse order


def _rounds(fns: dict) -> dict:
    """{variant: (median eager s, median graph s, extra)}: every variant of one shape timed ROUNDS times, the order
    reversed every other round (the clock / power state drifts within a run: R3 saw up to 10 % between calls of
    one kernel); with more than one round, extra holds each round's times."""
    names = list(fns)
    got: dict = {v: [] for v in names}
    for r in range(ROUNDS):
        for v in names if r % 2 == 0 else names[::-1]:
            got[v].append(_times(fns[v]))
    out = {}
    for v, ts in got.items():
        # statistics.median: the mean of the middle two for an even count (session 28's two rounds reported the
        # slower one)
        extra = {"rounds_us": [t * 1e6 for t, _ in ts], "rounds_graph_us": [tg * 1e6 for _, tg in ts]} if ROUNDS > 1 else {}
        out[v] = (statistics.median(t for t, _ in ts), statistics.median(tg for _, tg in ts), extra)
    return out


def _variant_row(res, label, v, t, tg, flops, d, ref, **extra):
    """res[v]: the variant's eager and graph times and rates (+ extra), and its output's calc_diff against the
    first variant's (ref; None: this is the first, whose output becomes ref); prints its row. Returns ref."""
    import tilehal

    res[v] = {"us": t * 1e6, "graph_us": tg * 1e6, "tflops": flops / t / 1e12, "graph_tflops": flops / tg / 1e12,
              **extra}
    if ref is None:
        ref = d.clone()
    else:
        res[v]["calc_diff_vs_first"] = float(tilehal.calc_diff(d, ref))
    print(f"{label} {v:13s} {t * 1e6:9.1f} us {flops / t / 1e12:7.0f} TFLOPS "
          f"(graph {flops / tg / 1e12:6.0f}) {res[v].get('calc_diff_vs_first', '')}", flush=True)
    return ref


def bench_contiguous(g, rows, n, k, variants) -> dict:
    import deepgemm

    m = g * rows
    a8, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    b8, sfb = _weights(g, n, k)
    idx = torch.arange(m, device="cuda", dtype=torch.int32) // rows
    flops = 2 * m * n * k
    res = {"kind": "fp8_grouped_contiguous", "shape": [g, rows, n, k]}
    ref = None
    runs = {}
    for v in variants:
        cfg, opts = contiguous_config(g, rows, n, k, v)
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

        def fn(cfg=cfg, opts=opts, d=d, uncapped=v == "mcast_uncapped"):
            capped = cuda_gemm.resident_cluster_ctas
            if uncapped:
                cuda_gemm.resident_cluster_ctas = lambda kern, cfg: None
            try:
                cuda_gemm.grouped_contiguous(a8, sfa, b8, sfb, d, idx, config=cfg, extra_options=opts)
            finally:
                cuda_gemm.resident_cluster_ctas = capped

        runs[v] = (cfg, d, fn)
    timed = _rounds({v: fn for v, (_, _, fn) in runs.items()})
    for v, (cfg, d, _) in runs.items():
        t, tg, extra = timed[v]
        if cfg.multicast > 1:
            extra["resident_cluster_ctas"] = cuda_gemm.resident_cluster_ctas(
                cuda_gemm._kernel(cuda_gemm.kernel_key(cfg, n, k, "contiguous", g, torch.bfloat16, False)), cfg)
        ref = _variant_row(res, f"contiguous {g}x{rows}x{n}x{k}", v, t, tg, flops, d, ref, block_n=cfg.block_n,
                           stages=cfg.stages, overlap=cfg.overlap_promotion, tile_info=cfg.use_tile_info,
                           multicast=cfg.multicast, expert_band=cfg.expert_band if cfg.expert_raster else None, **extra)
    return res


def bench_swiglu(g, rows, n, k) -> dict:
    import deepgemm
    import tilehal

    m, f = g * rows, n // 2
    a8, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    w8, sfw = deepgemm.per_block_cast_to_fp8(w)
    wi8, sfwi = deepgemm.per_block_cast_to_fp8(deepgemm.swiglu_interleave(w))
    del w
    idx = torch.arange(m, device="cuda", dtype=torch.int32) // rows
    gate_up = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(m, f, device="cuda", dtype=torch.bfloat16)
    out = {}

    def unfused_gemm():
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a8, sfa), (w8, sfw), gate_up, idx)

    def unfused():
        unfused_gemm()
        out["unfused"] = deepgemm.silu_mul_cast_to_fp8(gate_up, tma_aligned_sf=True)

    def fused_gemm():
        deepgemm.m_grouped_fp8_gemm_nt_contiguous_swiglu((a8, sfa), (wi8, sfwi), act, idx)

    def fused():
        fused_gemm()
        out["fused"] = deepgemm.per_token_cast_to_fp8(act, tma_aligned_sf=True)

    res = {"kind": "moe_gate_up_swiglu", "shape": [g, rows, n, k]}
    flops = 2 * m * n * k
    for name, fn in (("unfused", unfused), ("unfused_gemm", unfused_gemm), ("fused", fused), ("fused_gemm", fused_gemm)):
        t, tg = _times(fn)
        res[name] = {"us": t * 1e6, "graph_us": tg * 1e6, "gemm_tflops": flops / t / 1e12}
        print(f"swiglu {g}x{rows}x{n}x{k} {name:13s} {t * 1e6:9.1f} us (graph {tg * 1e6:8.1f}) "
              f"{flops / t / 1e12:7.0f} TFLOPS-equivalent", flush=True)

    def deq(pair):
        q, sf = pair
        return q.float() * sf.repeat_interleave(128, dim=1)[:, :f]

    res["calc_diff_fused_vs_unfused"] = float(tilehal.calc_diff(deq(out["fused"]), deq(out["unfused"])))
    print(f"swiglu calc_diff fused vs unfused {res['calc_diff_fused_vs_unfused']:.2e}", flush=True)
    return res


def bench_masked(g, m, n, k, peer: bool) -> dict:
    import deepgemm

    a = torch.randn(g, m, k, device="cuda", dtype=torch.bfloat16)
    a8 = torch.empty(g, m, k, device="cuda", dtype=torch.float8_e4m3fn)
    sfa = torch.empty(g, m, ceil_div(k, 128), device="cuda")
    for i in range(g):
        a8[i], sfa[i] = deepgemm.per_token_cast_to_fp8(a[i])
    sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    b8, sfb = _weights(g, n, k)
    masked_m = torch.full((g,), m, device="cuda", dtype=torch.int32)
    flops = 2 * g * m * n * k
    res = {"kind": "fp8_grouped_masked", "shape": [g, m, n, k]}
    ref = None
    runs = {}
    for v in MASKED_VARIANTS:
        d = torch.empty(g, m, n, device="cuda", dtype=torch.bfloat16)
        cfg, opts = masked_variant(g, m, n, k, v)
        runs[v] = (d, lambda d=d, opts=opts, cfg=cfg: cuda_gemm.grouped_masked(a8, sfa, b8, sfb, d, masked_m, m,
                                                                               extra_options=opts, config=cfg))
    timed = _rounds({v: fn for v, (_, fn) in runs.items()})
    for v, (d, _) in runs.items():
        t, tg, extra = timed[v]
        ref = _variant_row(res, f"masked {g}x{m}x{n}x{k}", v, t, tg, flops, d, ref, **extra)
    first = next(iter(MASKED_VARIANTS))  # "default" unless --masked-variants leaves it out
    res.update({k2: res[first][k2] for k2 in ("us", "graph_us", "tflops", "graph_tflops")})
    if peer:
        ones_a, ones_b = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")

        def loop():
            for i in range(g):
                torch._scaled_mm(a8[i], b8[i].T, scale_a=ones_a, scale_b=ones_b, out_dtype=torch.bfloat16)

        pt, _ = _times(loop)
        res["scaled_mm_rowwise_loop_tflops"] = flops / pt / 1e12
    if peer:
        print(f"masked {g}x{m}x{n}x{k} peer {res['scaled_mm_rowwise_loop_tflops']:6.0f} TFLOPS", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=None, help="contiguous variants, comma-separated (default: serial,info,"
                                                    "info_overlap,mcast,mcast_uncapped; with --compile: every one)")
    ap.add_argument("--masked-variants", default=",".join(MASKED_VARIANTS))
    ap.add_argument("--no-swiglu", action="store_true")
    ap.add_argument("--compile", action="store_true", help="NVRTC-compile every kernel (no GPU) and exit")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--no-masked", action="store_true")
    ap.add_argument("--peer", action="store_true", help="also time the masked peer (per-group _scaled_mm)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rounds", type=int, default=1, help="time each shape's variants this many times (every other "
                                                        "round reversed) and report the medians")
    ap.add_argument("--once", action="store_true", help="one launch per variant of the first contiguous and masked "
                                                        "shapes, untimed (what ncu profiles)")
    args = ap.parse_args()
    global ROUNDS
    ROUNDS = max(1, args.rounds)
    variants = (args.variants or "serial,info,info_overlap,mcast,mcast_uncapped").split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"--variants: unknown {unknown}; expected some of {sorted(VARIANTS)}")
    if unknown := [v for v in args.masked_variants.split(",") if v not in MASKED_VARIANTS]:
        raise SystemExit(f"--masked-variants: unknown {unknown}; expected some of {sorted(MASKED_VARIANTS)}")
    for name in [v for v in MASKED_VARIANTS if v not in args.masked_variants.split(",")]:
        del MASKED_VARIANTS[name]
    if args.compile:  # the --variants / --masked-variants given, else every one
        compile_all(variants if args.variants else list(VARIANTS), args.jobs)
        return
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
            "timer": "tilehal.bench, CUDA events, L2 flushed, median of 30; graph_*: CUDA-graph replay",
            "rounds": ROUNDS}
    rows: list[dict] = []

    def keep(r: dict) -> None:  # written after every row: a run cut short keeps what it measured
        rows.append(r)
        if args.out:
            args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    if args.once:
        global ONCE
        ONCE = True
        bench_contiguous(*CONTIGUOUS[0], variants)
        bench_masked(*MASKED[0], False)
        return
    if not args.no_swiglu:
        keep(bench_swiglu(*SWIGLU))
    for s in CONTIGUOUS:
        keep(bench_contiguous(*s, variants))
    if not args.no_masked:
        for s in MASKED:
            keep(bench_masked(*s, args.peer))


if __name__ == "__main__":
    main()
