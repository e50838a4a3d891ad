# requires: cuda
"""FP4 weights vs bf16 cuBLAS (and deepgemm fp8) at decode shapes, one H200, same run.

Issue 19's target: >= 1.5x bf16 cuBLAS geo-mean at M in {1, 16, 64, 128}, (N, K) in {(7168, 2048),
(2112, 7168), (4096, 7168)}. Contenders: deepgemm fp8_fp4_gemm_nt (e4m3 activations, 1 x 128 scales) and
bf16_fp4_gemm_nt (bf16 activations), each on the mma.sync kernel (fp8_fp4, bf16_fp4) and on the wgmma one
(fp8_fp4_wgmma, bf16_fp4_wgmma; DEEPGEMM_FP4_KERNEL picks it per call), the streaming and the small-M kernels
(bf16_fp4_stream, bf16_fp4_small), the default policy (bf16_fp4_auto),
torch.matmul (cuBLAS bf16), deepgemm fp8_gemm_nt (128x128 weight scales). Timing: tilehal.bench with the L2 flushed before every call (median), and a CUDA-graph replay
(tilehal.bench_graph, L2 flushed too); both reported. GB/s counts the weight bytes (codes + scales) and
the activations once.

    python packages/deepgemm/benchmarks/bench_fp4.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import os
import platform
from pathlib import Path

import deepgemm
import tilehal
import torch

M_LIST = (1, 16, 64, 128)
NK = [(7168, 2048), (2112, 7168), (4096, 7168)]


def timed(fn, iters: int) -> tuple[float, float]:
    t = tilehal.bench(fn, warmup=3, iters=iters, flush_l2=True).median_s
    tg = tilehal.bench_graph(fn, warmup=3, iters=iters, flush_l2=True).median_s
    return t, tg


# fp8_fp4 / bf16_fp4: the mma.sync kernel; *_wgmma: the wgmma one; bf16_fp4_stream: the streaming kernel (M <= 16;
# the wgmma one above); bf16_fp4_small: the small-M kernel (M <= 32; above: as auto); bf16_fp4_auto: the default
# policy (DEEPGEMM_FP4_KERNEL=auto), the figure issue 19 counts
OURS = ("fp8_fp4", "fp8_fp4_wgmma", "bf16_fp4", "bf16_fp4_wgmma", "bf16_fp4_stream", "bf16_fp4_small", "bf16_fp4_auto",
        "bf16_fp4_dec", "fp8_fp4_dec", "fp8_fp4_auto")


def with_env(env: dict[str, str], fn):
    """fn with these environment variables set for the call (the FP4 planners and kernel choice read theirs per
    call; a graph captures the launch it made)."""
    def run():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
    return run


def with_kernel(kind: str, fn):
    """fn with DEEPGEMM_FP4_KERNEL=kind for the call."""
    return with_env({"DEEPGEMM_FP4_KERNEL": kind}, fn)


def parse_variants(spec: str | None) -> list[tuple[str, str, tuple[int, ...], dict[str, str]]]:
    """--variants 'label:contender:M,M:NAME=V,NAME=V;...': extra contenders that run `contender` with those
    environment variables (A/B of a planner knob, or DEEPGEMM_FP4_KERNEL_SOURCE=<previous header>) at those M."""
    out = []
    for part in filter(None, (spec or "").split(";")):
        label, base, ms, *env = part.split(":")
        if base not in OURS:
            raise SystemExit(f"--variants: {label}: expected a contender of {', '.join(OURS)}, got {base!r}")
        pairs = dict(kv.split("=", 1) for kv in ",".join(env).split(",") if kv)
        out.append((label, base, tuple(int(m) for m in ms.split(",")), pairs))
    return out


def case(m: int, n: int, k: int, iters: int, only: str | None = None, variants=()) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    packed, sf = deepgemm.cast_weights_to_fp4(w, gran_k=32)
    a8, sfa = deepgemm.per_token_cast_to_fp8(a)
    b8, sfb = deepgemm.per_block_cast_to_fp8(w)
    sfa_t = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    contenders = {
        # MN-major activation scales, as GemmLinear's fused cast writes them (else each call transposes them)
        "fp8_fp4": with_kernel("mma", lambda: deepgemm.fp8_fp4_gemm_nt((a8, sfa_t), (packed, sf), d)),
        "fp8_fp4_wgmma": with_kernel("wgmma", lambda: deepgemm.fp8_fp4_gemm_nt((a8, sfa_t), (packed, sf), d)),
        "bf16_fp4": with_kernel("mma", lambda: deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d)),
        "bf16_fp4_wgmma": with_kernel("wgmma", lambda: deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d)),
        "bf16_fp4_stream": with_kernel("stream", lambda: deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d)),
        "bf16_fp4_small": with_kernel("small", lambda: deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d)),
        "bf16_fp4_auto": with_kernel("auto", lambda: deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d)),
        # the decode-to-shared kernel (DEEPGEMM_FP4_KERNEL=dec), bf16 / e4m3 activations (e4m3: already cast, as
        # for fp8_fp4 and deepgemm_fp8)
        "bf16_fp4_dec": with_kernel("dec", lambda: deepgemm.bf16_fp4_gemm_nt(a, (packed, sf), d)),
        "fp8_fp4_dec": with_kernel("dec", lambda: deepgemm.fp8_fp4_gemm_nt((a8, sfa_t), (packed, sf), d)),
        "fp8_fp4_auto": with_kernel("auto", lambda: deepgemm.fp8_fp4_gemm_nt((a8, sfa_t), (packed, sf), d)),
        "cublas_bf16": lambda: torch.matmul(a, w.T),
        # the e4m3 activations' cast alone (excluded from fp8_fp4* and deepgemm_fp8: add it for a bf16-input figure)
        "cast_fp8": lambda: deepgemm.per_token_cast_to_fp8(a, tma_aligned_sf=True),
        "deepgemm_fp8": lambda: deepgemm.fp8_gemm_nt((a8, sfa_t), (b8, sfb), d),
    }
    base = dict(contenders)
    if only:
        contenders = {k2: v for k2, v in contenders.items() if k2 in only.split(",")}
    for label, name, ms, env in variants:
        if m in ms:
            contenders[label] = with_env(env, base[name])
    ours = [o for o in contenders if o in OURS or o in {v[0] for v in variants}]
    # correctness of ours in the same run (float64 reference on the GPU)
    r = {"m": m, "n": n, "k": k}
    refs = {"fp8": deepgemm.fp4.reference(a8, sfa, packed, sf, 32), "bf16": deepgemm.fp4.reference(a, None, packed, sf, 32)}
    kinds = {label: name for label, name, _, _ in variants}
    for name in ours:
        d.zero_()
        contenders[name]()
        ref = refs[kinds.get(name, name).split("_")[0]]
        r[f"calc_diff_{name}"] = deepgemm.testing.calc_diff(d.float(), ref.float())
    weight_bytes = packed.numel() + sf.numel() * 4
    for name, fn in contenders.items():
        t, tg = timed(fn, iters)
        r[f"{name}_us"], r[f"{name}_graph_us"] = t * 1e6, tg * 1e6
    if "fp8_fp4" in contenders:
        r["fp4_weight_gbps"] = (weight_bytes + a8.numel()) / (r["fp8_fp4_us"] * 1e-6) / 1e9
    for o in ours:
        if "cublas_bf16" in contenders:
            r[f"{o}_vs_cublas_bf16"] = r["cublas_bf16_us"] / r[f"{o}_us"]
            r[f"{o}_vs_cublas_bf16_graph"] = r["cublas_bf16_graph_us"] / r[f"{o}_graph_us"]
        if "deepgemm_fp8" in contenders:
            r[f"{o}_vs_deepgemm_fp8"] = r["deepgemm_fp8_us"] / r[f"{o}_us"]
    return r


# --ncu-launch cases: (M, N, K, e4m3 activations, DEEPGEMM_FP4_KERNEL), one launch each
NCU_CASES = {
    "wgmma_64": (64, 4096, 7168, False, "wgmma"), "wgmma_128": (128, 4096, 7168, False, "wgmma"),
    "wgmma_128_2112": (128, 2112, 7168, False, "wgmma"), "wgmma_e4m3_128": (128, 4096, 7168, True, "wgmma"),
    "mma_e4m3_128": (128, 4096, 7168, True, "mma"), "mma_e4m3_64": (64, 4096, 7168, True, "mma"),
    "mma_1": (1, 4096, 7168, False, "mma"), "mma_16": (16, 4096, 7168, False, "mma"),
    "wgmma_1": (1, 4096, 7168, False, "wgmma"), "stream_1": (1, 4096, 7168, False, "stream"),
    "stream_16": (16, 4096, 7168, False, "stream"), "stream_64": (64, 4096, 7168, False, "stream"),
    "small_1": (1, 4096, 7168, False, "small"), "small_16": (16, 4096, 7168, False, "small"),
    "small_1_2112": (1, 2112, 7168, False, "small"), "small_1_7168": (1, 7168, 2048, False, "small"),
    "dec_128": (128, 4096, 7168, False, "dec"), "dec_128_2112": (128, 2112, 7168, False, "dec"),
    "dec_e4m3_128": (128, 4096, 7168, True, "dec"), "dec_e4m3_128_2112": (128, 2112, 7168, True, "dec"),
    "dec_e4m3_64": (64, 4096, 7168, True, "dec"), "wgmma_e4m3_128_2112": (128, 2112, 7168, True, "wgmma"),
    # the peer: deepgemm fp8_gemm_nt (fp8 weights, 128 x 128 scales) at the same shapes
    "peer_fp8_128": (128, 4096, 7168, True, "peer"), "peer_fp8_128_2112": (128, 2112, 7168, True, "peer"),
    "peer_fp8_64": (64, 4096, 7168, True, "peer"),
    # the warp-specialized dec kernel (DEEPGEMM_FP4_DEC_WS=3 set by the caller)
    "ws_128": (128, 4096, 7168, False, "dec"), "ws_e4m3_128": (128, 4096, 7168, True, "dec"),
    "ws_e4m3_128_2112": (128, 2112, 7168, True, "dec"), "ws_64": (64, 4096, 7168, False, "dec"),
}


def describe(p) -> dict | None:
    """A small-kernel plan in a line: row warps x k-warps, splits, chunks per split, CTAs, clusters, slots, build."""
    if p is None:
        return None
    return {"rw": p.key.rw, "kw": p.key.kw, "splits": p.splits, "cps": p.chunks_per_split,
            "ctas": p.row_blocks * p.splits * p.m_blocks, "clusters": p.tiles_all, "slots": p.key.slots,
            "minb": p.key.minb}


def show_plans(ms, out: Path | None) -> None:
    """The small kernel's plans on this device at the issue rows (bf16 out): the GPC model's, what the launch's
    step-down makes of it (_fit_clusters), DEEPGEMM_FP4_SMALL_FIT=driver's, and the driver's cluster count of
    every candidate (compiles each candidate's kernel)."""
    from deepgemm import cuda_fp4

    dev = torch.cuda.current_device()
    rows = []
    for n, k in NK:
        for m in ms:
            if m > cuda_fp4.SMALL_MAX_M:
                continue

            def replan(most=None, m=m, n=n, k=k):
                return cuda_fp4.plan_small(m, n, k, 1, True, False, False, max_splits=most)

            model = replan()
            stepped = cuda_fp4._fit_clusters(model, torch.device("cuda", dev), replan) if model else None
            forced = cuda_fp4._small_forced()
            fitted = cuda_fp4._plan_small_driver(m, n, k, 1, True, False, False, None, dev, forced, None)
            counts = {f"rw{c.key.rw}_s{c.splits}": {
                "driver": cuda_fp4._max_active_clusters(c.key, c.splits, dev, c.smem), "clusters": c.tiles,
                "gpc_model": cuda_fp4.cluster_capacity(cuda_fp4.get_num_sms(), c.fit, c.splits) if c.splits > 1
                else c.fit * cuda_fp4.get_num_sms()}
                for c in cuda_fp4._small_candidates(m, n, k, 1, True, False, False, None,
                                                    cuda_fp4.MAX_CLUSTER_SPLITS, forced)}
            r = {"m": m, "n": n, "k": k, "model": describe(model), "stepped": describe(stepped),
                 "driver": describe(fitted), "counts": counts}
            rows.append(r)
            print(f"M={m:4d} N={n:5d} K={k:5d}  model {r['model']}\n  stepped {r['stepped']}\n  driver  {r['driver']}",
                  flush=True)
            print("  counts (driver / GPC model / clusters): " + "  ".join(
                f"{name} {c['driver']}/{c['gpc_model']}/{c['clusters']}" for name, c in counts.items()), flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name(), "rows": rows}
        (out / "deepgemm_fp4_small_plans.json").write_text(json.dumps(doc, indent=1))


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ncu-launch", action="store_true", help="one launch of a few FP4 cases (for ncu), then exit")
    ap.add_argument("--ncu-cases", default=",".join(NCU_CASES), help="with --ncu-launch: which of NCU_CASES")
    ap.add_argument("--ms", default=None, help="comma-separated M values (default: 1,16,64,128)")
    ap.add_argument("--only", default=None, help="comma-separated contenders (default: all)")
    ap.add_argument("--variants", default=None, help="extra contenders: 'label:contender:M,M:NAME=V,...;...'")
    ap.add_argument("--plans", action="store_true",
                    help="print the small kernel's plans (GPC model, stepped down, driver counts), then exit")
    args = ap.parse_args()
    if args.plans:
        show_plans(tuple(int(x) for x in args.ms.split(",")) if args.ms else M_LIST, args.out)
        return
    if args.ncu_launch:
        for name in args.ncu_cases.split(","):
            if name not in NCU_CASES:
                raise SystemExit(f"--ncu-cases: expected some of {', '.join(NCU_CASES)}, got {name!r}")
            m, n, k, fp8, kind = NCU_CASES[name]
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            if kind == "peer":
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
                a8, sfa = deepgemm.per_token_cast_to_fp8(a)
                sfa_t = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
                deepgemm.fp8_gemm_nt((a8, sfa_t), deepgemm.per_block_cast_to_fp8(w), d)
                torch.cuda.synchronize()
                continue
            packed, sf = deepgemm.cast_weights_to_fp4(torch.randn(n, k, device="cuda") * 0.05)
            act = deepgemm.per_token_cast_to_fp8(a) if fp8 else a
            fn = deepgemm.fp8_fp4_gemm_nt if fp8 else deepgemm.bf16_fp4_gemm_nt
            with_kernel(kind, functools.partial(fn, act, (packed, sf), d))()
            torch.cuda.synchronize()
        return
    iters = 10 if args.quick else 30
    variants = parse_variants(args.variants)
    rows = []
    ms = tuple(int(x) for x in args.ms.split(",")) if args.ms else M_LIST
    for n, k in NK:
        for m in ms:
            r = case(m, n, k, iters, args.only, variants)
            rows.append(r)
            if args.only or variants:
                names = [k2[:-3] for k2 in r if k2.endswith("_us") and not k2.endswith("_graph_us")]
                print(f"M={m:4d} N={n:5d} K={k:5d}  " + "  ".join(
                    f"{o} {r[o + '_us']:5.1f} ({r[o + '_graph_us']:5.1f})"
                    + (f" x{r[o + '_vs_cublas_bf16']:.2f}" if o + "_vs_cublas_bf16" in r else "")
                    + (f" d{r['calc_diff_' + o]:.0e}" if "calc_diff_" + o in r else "") for o in names), flush=True)
                continue
            ours = "  ".join(f"{o} {r[f'{o}_us']:5.1f} ({r[f'{o}_graph_us']:5.1f}) x{r[f'{o}_vs_cublas_bf16']:.2f}"
                             for o in OURS)
            print(f"M={m:4d} N={n:5d} K={k:5d}  {ours}  cublas_bf16 {r['cublas_bf16_us']:5.1f} "
                  f"({r['cublas_bf16_graph_us']:5.1f})  deepgemm_fp8 {r['deepgemm_fp8_us']:5.1f}  "
                  "diff " + " ".join(f"{r['calc_diff_' + o]:.1e}" for o in OURS), flush=True)
    # geo-means over the rows each contender ran (a variant: its M values only)
    names = list(dict.fromkeys(k[: -len("_vs_cublas_bf16")] for r in rows for k in r if k.endswith("_vs_cublas_bf16")))
    present = [o for o in names if o in OURS]
    summary = {}
    for o in names:
        for sfx in ("_vs_cublas_bf16", "_vs_cublas_bf16_graph", "_vs_deepgemm_fp8"):
            xs = [r[o + sfx] for r in rows if o + sfx in r]
            if xs:
                summary[f"geomean_{o}{sfx}"] = geomean(xs)
                summary[f"rows_{o}"] = len(xs)
    print(json.dumps(summary, indent=1))
    if args.out and (not args.only or present):
        doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
               "timing": "tilehal.bench median, L2 flushed before each call; *_graph_us: CUDA-graph replay (L2 "
                         "flushed); ratios > 1: ours faster", "summary": summary, "rows": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "deepgemm_fp4_h200.json").write_text(json.dumps(doc, indent=1))
        plot(rows, args.out / "deepgemm_fp4_h200.png")


def plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['m']}x{r['n']}x{r['k']}" for r in rows]
    x = range(len(rows))
    names = [o for o in (*OURS, "deepgemm_fp8") if f"{o}_us" in rows[0]]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([v + width * i for v in x], [r["cublas_bf16_us"] / r[f"{name}_us"] for r in rows], width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.5, color="r", lw=0.8, ls="--", label="target 1.5x")
    ax.set_xticks([v + 0.4 for v in x])
    ax.set_xticklabels(labels, rotation=60, fontsize=7)
    ax.set_ylabel("speed vs cuBLAS bf16 (L2 flushed)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
