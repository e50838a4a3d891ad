"""tilelang's CUDA backend on the GPU vs cuBLAS / SDPA and vs the public TileLang on the same source.

    python bench_cuda.py [--public /tmp/ptl] [--out DIR] [--quick]
    python bench_cuda.py --compile-only [--out DIR]     # no GPU: compile times only

Kernels: benchmarks/cuda_kernels.py (public TileLang style). GEMM NT fp16/bf16 at 8192^3 and
M=4096 with (N, K) in (7168, 2048), (2112, 7168), (24576, 1536); flash attention forward bhsd
fp16 d128 at b4 h32 s4096 and b1 h32 s16384, causal and not. --ab also times the opt-in forms of session 26:
"ours_ov" / "ours_ovpp" (cuda_ws_overlap, + pingpong; flash attention at 2 or 3 stages) and "ours_wsm"
(cuda_ws_multicast); `--only gemm|fa` and `--skip IMPL,...` trim a run. Ours up to four times: "ours" (the sm_90a defaults: T.gemm on
wgmma, pipelined copies on TMA), "ours_ws" (pass_configs cuda_warp_specialize: a producer warpgroup issues
the TMA loads), "ours_wsp" (+ cuda_persistent: one block per SM loops over the tiles), "ours_pp" (flash attention
with cuda_ws_pingpong: the two consumer warpgroups take turns on the tensor cores; "ours_ppp" also
persistent), "ours_cp" (tl.disable_tma_lower: copies on cp.async) and "ours_mma" (tl.disable_wgmma:
ldmatrix + mma.sync + cp.async); `--best-from JSON` times only the (config, refill) pairs a JSON marks best
(several per shape allowed); `--short` the short lists of SHORT_CONFIGS (a GPU round of ~100 s). Timing: 10 calls captured in a
CUDA graph, replayed (median of 5 replays), so launch overhead is not measured for anyone. Compile:
cold (parse + lower + NVRTC with an empty cache dir) and cached (a new JITKernel of the same prim_func:
the kernel cache finds the generated CUDA by the program's structure, the cubin cache the binary)
wall times.
The public TileLang runs the same file in a child process with only its bundle on PYTHONPATH
(`--impl public`); its rows are merged into the JSON. Nothing asserts a time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
GEMM_SHAPES = [(8192, 8192, 8192), (4096, 7168, 2048), (4096, 2112, 7168), (4096, 24576, 1536)]
# ours (wgmma): the tile configurations tried per (M, N, K), each with the pipeline's two refill schemes
# ("2b": refill the previous iteration's stage behind a second barrier; "1b": pass_configs
# cuda_wgmma_one_barrier, refill the stage of two iterations back behind the only barrier).
# N = 2112 is 11 tiles of 192 (352 tiles: 2.67 waves of 132 SMs) or 12 of 176 (384: 2.91 waves).
# A sixth element "c_shared": the epilogue staged through shared memory (cuda_kernels.gemm_nt(c_shared=True)).
_BIG = [(128, 256, 64, 4, 256)]
GEMM_CONFIGS = {
    (8192, 8192, 8192): _BIG,
    (4096, 7168, 2048): _BIG,
    (4096, 2112, 7168): [(128, 192, 64, 4, 256), (128, 176, 64, 4, 256), (128, 192, 64, 5, 256),
                         (128, 176, 64, 5, 256), (128, 192, 64, 5, 256, "c_shared")],
    (4096, 24576, 1536): _BIG + [(128, 128, 64, 3, 256), (128, 256, 64, 4, 256, "c_shared")],
}
VARIANTS = ("2b", "1b")
# --short: the configurations that won in the 2026-12-02 04:08 run (TMA), and for ours_ws the candidates
SHORT_CONFIGS = {
    "ours": {(8192, 8192, 8192): [((128, 256, 64, 4, 256), "1b"), ((128, 256, 64, 4, 256), "2b")],
             (4096, 7168, 2048): [((128, 256, 64, 4, 256), "1b")],
             (4096, 2112, 7168): [((128, 192, 64, 5, 256, "c_shared"), "1b")],
             (4096, 24576, 1536): [((128, 256, 64, 4, 256, "c_shared"), "1b")]},
    "ours_ws": {(8192, 8192, 8192): [((128, 256, 64, 4, 256), "ws")],
                (4096, 7168, 2048): [((128, 256, 64, 4, 256), "ws"), ((128, 256, 64, 4, 256, "c_shared"), "ws")],
                (4096, 2112, 7168): [((128, 192, 64, 5, 256), "ws"), ((128, 192, 64, 5, 256, "c_shared"), "ws"),
                                     ((128, 176, 64, 5, 256, "c_shared"), "ws")],
                (4096, 24576, 1536): [((128, 256, 64, 4, 256), "ws"), ((128, 256, 64, 4, 256, "c_shared"), "ws")]},
    "ours_pp": {shape: [] for shape in GEMM_SHAPES},  # flash attention only (the GEMMs have no turns to take)
    "ours_ppp": {shape: [] for shape in GEMM_SHAPES},  # ... and persistent
    "ours_wsp": {(8192, 8192, 8192): [((128, 256, 64, 4, 256), "wsp"), ((128, 256, 64, 3, 256, "c_shared"), "wsp")],
                 (4096, 7168, 2048): [((128, 256, 64, 4, 256), "wsp"), ((128, 256, 64, 3, 256, "c_shared"), "wsp")],
                 (4096, 2112, 7168): [((128, 192, 64, 5, 256), "wsp"), ((128, 192, 64, 4, 256, "c_shared"), "wsp")],
                 (4096, 24576, 1536): [((128, 256, 64, 4, 256), "wsp"), ((128, 256, 64, 3, 256, "c_shared"), "wsp")]},
}
SHORT = False
ONLY: str | None = None  # --only gemm|fa: time one kind of kernel
SKIP: set[str] = set()  # --skip IMPL,...: leave these contenders out of --ab (e.g. a form whose GPU test failed)


def _gemm_dtypes() -> tuple[str, ...]:
    return () if ONLY == "fa" else ("float16", "bfloat16")


def _fa_shapes(quick: bool) -> list[tuple[int, int, int, int]]:
    return [] if ONLY == "gemm" else FA_SHAPES[:1] if quick else FA_SHAPES
MMA_GEMM_CONFIGS = [(128, 256, 64, 3, 256), (128, 128, 32, 4, 128)]  # ours_mma: the best two of 2026-12-01
PUBLIC_GEMM_CONFIG = (128, 256, 64, 3, 256)  # the configuration measured in ../shared/GPU.md
FA_SHAPE = (4, 32, 4096, 128)
FA_SHAPES = [FA_SHAPE, (1, 32, 16384, 128)]  # issue 21's two flash-attention shapes (bhsd, fp16, d128)


REPLAYS = 5  # --replays: timed replays of each graph (median)
WARM = False  # --warm-cache: compiles hit a cache built by --build-only (no second "cached" compile per contender)
TUNE_NO_CHECK = False  # --tune-no-check: the autotuner times its candidates without its reference check (faster)


def graph_time_ms(fn, reps: int = 10, replays: int | None = None) -> float:
    replays = replays or REPLAYS
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return sorted(times)[len(times) // 2]




def _pass_configs(impl: str, variant: str = "2b") -> dict | None:
    """ours: the sm_90a defaults (wgmma, TMA); ours_ws: warp-specialized TMA pipelines; ours_cp: copies on
    cp.async; ours_mma: mma.sync (issue 14's generation)."""
    if impl == "ours_mma":
        return {"tl.disable_wgmma": True, "tl.disable_tma_lower": True}
    cfg = ({"cuda_warp_specialize": True} if impl in ("ours_ws", "ours_wsp", "ours_pp", "ours_ppp", "ours_nov", "ours_wsm",
                                                      "ours_ov", "ours_ovpp", *S27_IMPLS) else {})
    cfg.update(S27_IMPLS.get(impl, {}))
    if impl in ("ours_ov", "ours_ovpp"):  # + the FA3 gemm/softmax overlap (cuda_ws_overlap)
        cfg["cuda_ws_overlap"] = True
    if impl == "ours_ovpp":
        cfg["cuda_ws_pingpong"] = True
    if impl == "ours_wsm":  # + TMA multicast of the B tile across 2-CTA clusters
        cfg["cuda_ws_multicast"] = True
    if impl == "ours_nov":  # warp-specialized without the gemm/softmax overlap (the default before 2026-12-02 R1)
        cfg["cuda_ws_overlap"] = False
    if impl in ("ours_pp", "ours_ppp"):
        cfg["cuda_ws_pingpong"] = True
    if impl in ("ours_wsp", "ours_ppp"):
        cfg["cuda_persistent"] = True
    if impl == "ours_cp":
        cfg["tl.disable_tma_lower"] = True
    if impl == "ours_tma":  # TMA pipelines with every thread in one role, whatever the default
        cfg["cuda_warp_specialize"] = False
    if variant == "1b":
        cfg["cuda_wgmma_one_barrier"] = True
    return cfg or None


# the opt-in forms of session 27 (never timed: next session's job A/Bs them against the default and the peer)
S27_IMPLS = {
    "ours_sp": {"cuda_ws_split_stages": True},  # flash attention: K and V stages on their own mbarriers
    "ours_ovsp": {"cuda_ws_split_stages": True, "cuda_ws_overlap": True},  # ... with the FA3 gemm/softmax overlap
    "ours_ovppsp": {"cuda_ws_split_stages": True, "cuda_ws_overlap": True, "cuda_ws_pingpong": True},
    "ours_ppsp": {"cuda_ws_split_stages": True, "cuda_ws_pingpong": True},
    "ours_two": {"cuda_ws_two_ctas": True},  # GEMM: two warp-specialized CTAs per SM (producer warp), 128 x 128 tiles
}
# session 29 (issue 21): the float32 instruction forms of the softmax (backends/cuda/codegen.py MATH_OPTIONS):
# one MUFU.EX2 per T.exp2, FMNMX max, reductions over independent partials; "fm" = all three on top of a form
FAST_MATH = {"cuda_fast_exp2": True, "cuda_fmnmx": True, "cuda_tree_reduce": True}
_FORMS = {"ws": {}, "ov": {"cuda_ws_overlap": True}, "ovpp": {"cuda_ws_overlap": True, "cuda_ws_pingpong": True},
          "ovppsp": S27_IMPLS["ours_ovppsp"]}
S29_IMPLS = {f"ours_{f}fm": {**cfg, **FAST_MATH} for f, cfg in _FORMS.items()}
_P = {"cuda_persistent": True}  # + persistent: one CTA per SM loops over the tiles (the epilogue under the next loads)
S29_IMPLS["ours_povppspfm"] = {**S29_IMPLS["ours_ovppspfm"], **_P}
S29_IMPLS["ours_pppfm"] = {"cuda_ws_pingpong": True, **_P, **FAST_MATH}
# round 2: + cuda_fast_div ("fmd" = all four = tl.enable_fast_math); ncu of round 1 put ~5 % (full) / ~9 % (causal) of
# the samples in the epilogue, most of it in the 64 IEEE divisions O / row sum per thread
FAST_MATH_D = {**FAST_MATH, "cuda_fast_div": True}
S29_IMPLS.update({f"ours_{f}fmd": {**cfg, **FAST_MATH_D} for f, cfg in _FORMS.items()})
# + a producer thread per split group (cuda_ws_split_producers: K's loads never wait behind V's stage)
_SP = {"cuda_ws_split_producers": True}
S29_IMPLS["ours_ovppspfmp"] = {**S29_IMPLS["ours_ovppspfm"], **_SP}
S29_IMPLS["ours_ovppspfmdp"] = {**S29_IMPLS["ours_ovppspfmd"], **_SP}
S29_IMPLS["ours_ovspfmdp"] = {**S27_IMPLS["ours_ovsp"], **FAST_MATH_D, **_SP}
S29_IMPLS["ours_ovppspe"] = {**S27_IMPLS["ours_ovppsp"], "cuda_fast_exp2": True}  # attribution: exp2 alone
S29_IMPLS["ours_ovppspmx"] = {**S27_IMPLS["ours_ovppsp"], "cuda_fmnmx": True, "cuda_tree_reduce": True}  # max / sums
S27_IMPLS.update(S29_IMPLS)


def _cached_compile(tilelang, impl: str, func, out_idx, variant: str = "2b") -> float:
    """Seconds to build `func` again with its binary in the disk cache: ours builds a new JITKernel
    (bypassing the in-process memo of tilelang.compile; the kernel cache finds the generated CUDA by the
    program's structure, the cubin cache the binary); the public TileLang's second tilelang.compile hits
    its own kernel cache."""
    t0 = time.perf_counter()
    if impl.startswith("ours"):
        tilelang.JITKernel(func, out_idx=out_idx, target="cuda", pass_configs=_pass_configs(impl, variant))
    else:
        tilelang.compile(func, out_idx=out_idx, target="cuda")
    return time.perf_counter() - t0


def _compile_kw(impl: str, variant: str = "2b") -> dict:
    return {"pass_configs": _pass_configs(impl, variant)} if impl.startswith("ours") else {}


BEST: dict[tuple, list[tuple[tuple, str]]] = {}  # --best-from: (impl, dtype, shape) -> (config, variant)s


def load_best(path: str) -> None:
    """The (config, refill variant) pairs marked best per (impl, dtype, shape) in an earlier run's JSON."""
    for r in json.loads(Path(path).read_text())["rows"]:
        if r.get("best") and r.get("kind") == "gemm" and "config" in r:
            BEST.setdefault((r["impl"], r["dtype"], tuple(r["shape"])), []).append(
                (tuple(r["config"]), r.get("variant", "2b")))


def _configs(impl: str, shape: tuple, quick: bool, dtype: str = "bfloat16") -> list[tuple[tuple, str]]:
    """(tile config, refill variant) pairs to try for one GEMM shape."""
    if (impl, dtype, tuple(shape)) in BEST:
        return list(BEST[(impl, dtype, tuple(shape))])
    if SHORT and impl in SHORT_CONFIGS:
        return list(SHORT_CONFIGS[impl][tuple(shape)])
    if impl == "public":
        out = [(PUBLIC_GEMM_CONFIG, "-")]
    elif impl == "ours_mma":
        out = [(c, "-") for c in MMA_GEMM_CONFIGS]
    elif impl in ("ours_ws", "ours_wsp"):
        out = [(c, impl[5:]) for c in GEMM_CONFIGS[shape]]
    else:
        out = [(c, v) for c in GEMM_CONFIGS[shape] for v in VARIANTS]
    return out[:1] if quick else out


def _gemm_cases(impl: str, quick: bool):
    shapes = GEMM_SHAPES[:2] if quick else GEMM_SHAPES
    for dtype in _gemm_dtypes():
        for shape in shapes:
            if dtype == "float16" and shape != GEMM_SHAPES[0]:
                continue  # fp16 at 8192^3 only, as the issue asks; bf16 for every shape
            for cfg, variant in _configs(impl, shape, quick, dtype):
                yield dtype, shape, cfg, variant


def precompile(impl: str, quick: bool, go_file: str) -> dict:
    """Build every kernel run_impl will time (cold compile times, keyed like its rows), then wait until
    `go_file` exists: the public TileLang's slow compiles overlap the parent's work, its timing does not."""
    sys.path.insert(0, str(HERE))
    import cuda_kernels as ck
    import tilelang

    cold = {}
    for dtype, (M, N, K), cfg, variant in _gemm_cases(impl, quick):
        t0 = time.perf_counter()
        try:
            tilelang.compile(ck.gemm_nt(M, N, K, *cfg[:5], dtype, c_shared="c_shared" in cfg[5:]), out_idx=[-1],
                             target="cuda", **_compile_kw(impl, variant))
        except Exception as e:
            print(f"[{impl}] precompile gemm {dtype} {M}x{N}x{K} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        cold[("gemm", dtype, (M, N, K), tuple(cfg), variant)] = time.perf_counter() - t0
    for shape in _fa_shapes(quick):
        for causal in (False, True):
            t0 = time.perf_counter()
            try:
                tilelang.compile(ck.flashattn_bhsd(*shape, causal), out_idx=[3], target="cuda", **_compile_kw(impl))
            except Exception as e:
                print(f"[{impl}] precompile fa {shape} causal={causal}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            cold[("fa", tuple(shape), causal)] = time.perf_counter() - t0
    print(f"[{impl}] precompiled {len(cold)} kernels in {sum(cold.values()):.1f} s; waiting for {go_file}", flush=True)
    t0 = time.perf_counter()
    while not os.path.exists(go_file) and time.perf_counter() - t0 < 600:
        time.sleep(0.05)
    return cold


def run_impl(impl: str, quick: bool, pre: dict | None = None) -> list[dict]:
    """Time `impl` on every kernel; `pre`: cold compile times measured by precompile (the compiles here
    then hit the caches)."""
    sys.path.insert(0, str(HERE))
    import cuda_kernels as ck
    import tilelang

    pre = pre or {}
    rows = []
    shapes = GEMM_SHAPES[:2] if quick else GEMM_SHAPES
    for dtype in _gemm_dtypes():
        tdt = getattr(torch, dtype)
        for M, N, K in shapes:
            if dtype == "float16" and (M, N, K) != GEMM_SHAPES[0]:
                continue  # fp16 at 8192^3 only, as the issue asks; bf16 for every shape
            a = torch.randn(M, K, device="cuda", dtype=tdt)
            b = torch.randn(N, K, device="cuda", dtype=tdt)
            ref = (a.float() @ b.float().T)
            best = None
            for cfg, variant in _configs(impl, (M, N, K), quick, dtype):
                try:
                    t0 = time.perf_counter()
                    func = ck.gemm_nt(M, N, K, *cfg[:5], dtype, c_shared="c_shared" in cfg[5:])
                    k = tilelang.compile(func, out_idx=[-1], target="cuda", **_compile_kw(impl, variant))
                    cold = time.perf_counter() - t0  # parse + lower + NVRTC, empty cache
                    cold = pre.get(("gemm", dtype, (M, N, K), tuple(cfg), variant), cold)
                    cached = _cached_compile(tilelang, impl, func, [-1], variant)
                    c = k(a, b)
                    err = ((c.float() - ref).norm() / ref.norm()).item()
                    ms = graph_time_ms(functools.partial(k, a, b))
                except Exception as e:  # a config that does not build is reported, not fatal
                    rows.append({"impl": impl, "kind": "gemm", "dtype": dtype, "shape": [M, N, K], "config": cfg,
                                 "variant": variant, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    print(f"[{impl}] gemm {dtype} {M}x{N}x{K} {cfg} {variant}: {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
                    continue
                tflops = 2 * M * N * K / ms / 1e9
                row = {"impl": impl, "kind": "gemm", "dtype": dtype, "shape": [M, N, K], "config": list(cfg),
                       "variant": variant, "ms": ms, "tflops": tflops, "rel_err": err, "compile_cold_s": cold,
                       "compile_cached_s": cached}
                rows.append(row)
                print(f"[{impl}] gemm {dtype} {M}x{N}x{K} {cfg} {variant}: {ms:.3f} ms {tflops:.0f} TFLOP/s err {err:.1e} "
                      f"compile {cold:.2f}s / {cached * 1e3:.1f}ms", flush=True)
                if best is None or tflops > best["tflops"]:
                    best = row
            if best:
                best["best"] = True
    for b_, h, s, d in _fa_shapes(quick):
      for causal in (False, True):
        q, kk, v = (torch.randn(b_, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
        try:
            t0 = time.perf_counter()
            func = ck.flashattn_bhsd(b_, h, s, d, causal)
            k = tilelang.compile(func, out_idx=[3], target="cuda", **_compile_kw(impl))
            cold = pre.get(("fa", (b_, h, s, d), causal), time.perf_counter() - t0)
            cached = _cached_compile(tilelang, impl, func, [3])
            o = k(q, kk, v)
            ref = torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=causal)
            err = (o.float() - ref.float()).abs().max().item()
            ms = graph_time_ms(functools.partial(k, q, kk, v))
        except Exception as e:
            rows.append({"impl": impl, "kind": "fa", "causal": causal, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"[{impl}] fa causal={causal}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        flops = 4 * b_ * h * s * s * d * (0.5 if causal else 1.0)
        row = {"impl": impl, "kind": "fa", "causal": causal, "shape": [b_, h, s, d], "ms": ms,
               "tflops": flops / ms / 1e9, "max_abs_err": err, "compile_cold_s": cold, "compile_cached_s": cached,
               "best": True}
        print(f"[{impl}] fa causal={causal}: {ms:.3f} ms {row['tflops']:.0f} TFLOP/s err {err:.1e} compile "
              f"{cold:.2f}s / {cached * 1e3:.1f}ms", flush=True)
        rows.append(row)
    return rows


# --ab: the candidates of the 2026-12-02 R1 run per kernel, timed interleaved with the peer
AB_GEMM = {  # ours_wsm: warp-specialized + TMA multicast of the B tile across 2-CTA clusters (2026-12-02 R2)
    (8192, 8192, 8192): [("ours_tma", (128, 256, 64, 4, 256), "1b"), ("ours_ws", (128, 256, 64, 4, 256), "ws"),
                         ("ours_wsp", (128, 256, 64, 4, 256), "wsp"), ("ours_wsm", (128, 256, 64, 4, 256), "wsm")],
    (4096, 7168, 2048): [("ours_ws", (128, 256, 64, 4, 256, "c_shared"), "ws"),
                         ("ours_wsp", (128, 256, 64, 3, 256, "c_shared"), "wsp"),
                         ("ours_wsm", (128, 256, 64, 4, 256, "c_shared"), "wsm")],
    (4096, 2112, 7168): [("ours_ws", (128, 176, 64, 5, 256, "c_shared"), "ws"),
                         ("ours_wsp", (128, 192, 64, 4, 256, "c_shared"), "wsp"),
                         ("ours_wsm", (128, 192, 64, 5, 256, "c_shared"), "wsm")],
    (4096, 24576, 1536): [("ours_ws", (128, 256, 64, 4, 256, "c_shared"), "ws"),
                          ("ours_wsp", (128, 256, 64, 3, 256, "c_shared"), "wsp"),
                          ("ours_wsm", (128, 256, 64, 4, 256, "c_shared"), "wsm")],
}
# flash attention: (impl, num_stages); ours_ws = the default (warp-specialized), ours_ov = + the FA3 gemm/softmax
# overlap (cuda_ws_overlap; R1 of 2026-12-02 09:46: 0.82x the default at 2 stages), ours_ovpp = overlap + pingpong
AB_FA = [("ours_ws", 2), ("ours_ov", 3), ("ours_ovpp", 2), ("ours_ovpp", 3)]
# --set s27: the session-27 forms against the default (ours_ws at its R3 config / 2 FA stages), the best forms of
# session 26 (multicast; overlap at 3 stages, + pingpong) and the peer, all in one interleaved run
_TWO_TILE = (128, 128, 64, 3, 256)
AB_GEMM_S27 = {
    (8192, 8192, 8192): [("ours_ws", (128, 256, 64, 4, 256), "ws"), ("ours_wsm", (128, 256, 64, 4, 256), "wsm"),
                         ("ours_two", _TWO_TILE, "two"), ("ours_two", (*_TWO_TILE, "c_shared"), "two")],
    (4096, 7168, 2048): [("ours_ws", (128, 256, 64, 4, 256, "c_shared"), "ws"),
                         ("ours_wsm", (128, 256, 64, 4, 256, "c_shared"), "wsm"),
                         ("ours_two", _TWO_TILE, "two"), ("ours_two", (*_TWO_TILE, "c_shared"), "two")],
    (4096, 2112, 7168): [("ours_ws", (128, 176, 64, 5, 256, "c_shared"), "ws"),
                         ("ours_wsm", (128, 192, 64, 5, 256, "c_shared"), "wsm"),
                         ("ours_two", _TWO_TILE, "two"), ("ours_two", (*_TWO_TILE, "c_shared"), "two")],
    (4096, 24576, 1536): [("ours_ws", (128, 256, 64, 4, 256, "c_shared"), "ws"),
                          ("ours_wsm", (128, 256, 64, 4, 256, "c_shared"), "wsm"),
                          ("ours_two", _TWO_TILE, "two"), ("ours_two", (*_TWO_TILE, "c_shared"), "two")],
}
# flash attention: the default (ws, 2 stages), session 26's best forms (overlap at 3 stages: full attention;
# + pingpong: causal b4 s4096) and the split-stage forms at 2 and 3 stages
AB_FA_S27 = [("ours_ws", 2), ("ours_ov", 3), ("ours_ovpp", 3), ("ours_sp", 2), ("ours_ovsp", 2), ("ours_ovppsp", 2),
             ("ours_ovsp", 3), ("ours_ovppsp", 3)]
# --set s29: flash attention only; the four forms of cuda_kernels.FA_DEFAULTS (ws 2 st., overlap 3 st., overlap +
# pingpong 3 st., split + overlap + pingpong 2 st.) as they are and with the session-29 fast softmax forms (FAST_MATH),
# and two persistent forms with them (split + overlap + pingpong; pingpong alone: R1 of session 25's best, 532 TFLOP/s)
AB_FA_S29 = [("ours_ws", 2), ("ours_ov", 3), ("ours_ovpp", 3), ("ours_ovppsp", 2),
             ("ours_wsfm", 2), ("ours_ovfm", 3), ("ours_ovppfm", 3), ("ours_ovppspfm", 2), ("ours_povppspfm", 2),
             ("ours_pppfm", 2)]
# --set s29b (session 29's second round): the previous per-shape forms, round 1's best fast forms, and the forms with
# cuda_fast_div as well, at 2 and 3 stages
AB_FA_S29B = [("ours_ws", 2), ("ours_ov", 3), ("ours_ovpp", 3), ("ours_ovppsp", 2), ("ours_ovfm", 3), ("ours_ovppspfm", 2),
              ("ours_wsfmd", 2), ("ours_ovfmd", 3), ("ours_ovppfmd", 3), ("ours_ovppspfmd", 2), ("ours_ovppspfmd", 3)]
# --set s29c (an optional third round): the new per-shape defaults against the split-producer forms
AB_FA_S29C = [("ours_ovppsp", 2), ("ours_ovppspfm", 2), ("ours_ovfmd", 3), ("ours_ovppspfmd", 2), ("ours_ovppspfmp", 2),
              ("ours_ovppspfmdp", 2), ("ours_ovppspfmdp", 3), ("ours_ovspfmdp", 3)]
AB_SETS = {"s26": (AB_GEMM, AB_FA), "s27": (AB_GEMM_S27, AB_FA_S27), "s29": ({s: [] for s in GEMM_SHAPES}, AB_FA_S29),
           "s29b": ({s: [] for s in GEMM_SHAPES}, AB_FA_S29B), "s29c": ({s: [] for s in GEMM_SHAPES}, AB_FA_S29C)}


def build_ab(ab_set: str = "s26") -> int:
    """Build (no GPU needed) every contender `run_ab` would time: warms the kernel and binary caches (under
    $TILESTACK_CACHE_DIR) for a later run with --warm-cache on the GPU. Returns the number built."""
    sys.path.insert(0, str(HERE))
    import cuda_kernels as ck
    import tilelang

    ab_gemm, ab_fa = AB_SETS[ab_set]
    n = 0
    for dtype in _gemm_dtypes():
        for M, N, K in GEMM_SHAPES:
            if dtype == "float16" and (M, N, K) != GEMM_SHAPES[0]:
                continue
            for impl, cfg, variant in ab_gemm[(M, N, K)]:
                if impl in SKIP:
                    continue
                func = ck.gemm_nt(M, N, K, *cfg[:5], dtype, c_shared="c_shared" in cfg[5:])
                tilelang.compile(func, out_idx=[-1], target="cuda", **_compile_kw(impl, variant))
                _cached_compile(tilelang, impl, func, [-1], variant)
                n += 1
    for b_, h, s_, d in _fa_shapes(False):
        for causal in (False, True):
            for impl, stages in ab_fa:
                if impl in SKIP:
                    continue
                func = ck.flashattn_bhsd(b_, h, s_, d, causal, num_stages=stages)
                tilelang.compile(func, out_idx=[3], target="cuda", **_compile_kw(impl))
                _cached_compile(tilelang, impl, func, [3])
                n += 1
    print(f"build: {n} contenders of --set {ab_set} built", flush=True)
    return n


def run_ab(rounds: int, save=None, ab_set: str = "s26") -> list[dict]:
    """Every candidate of the A/B set (AB_GEMM / AB_FA, or --set s27's) and its peer (cuBLAS / SDPA), built
    first, then timed in `rounds` rounds that each time every kernel's contenders back to back (the order rotating
    per round), so clock and temperature drift hit all of them alike; each row's time is the median over the
    rounds."""
    sys.path.insert(0, str(HERE))
    import cuda_kernels as ck
    import tilelang

    ab_gemm, ab_fa = AB_SETS[ab_set]
    items = []  # (row, fn)
    for dtype in _gemm_dtypes():
        tdt = getattr(torch, dtype)
        for M, N, K in GEMM_SHAPES:
            if dtype == "float16" and (M, N, K) != GEMM_SHAPES[0]:
                continue
            a = torch.randn(M, K, device="cuda", dtype=tdt)
            b = torch.randn(N, K, device="cuda", dtype=tdt)
            ref = a.float() @ b.float().T
            group = [({"impl": "cublas", "kind": "gemm", "dtype": dtype, "shape": [M, N, K]},
                      functools.partial(torch.matmul, a, b.T))]
            for impl, cfg, variant in ab_gemm[(M, N, K)]:
                if impl in SKIP:
                    continue
                row = {"impl": impl, "kind": "gemm", "dtype": dtype, "shape": [M, N, K], "config": list(cfg),
                       "variant": variant}
                try:
                    t0 = time.perf_counter()
                    func = ck.gemm_nt(M, N, K, *cfg[:5], dtype, c_shared="c_shared" in cfg[5:])
                    k = tilelang.compile(func, out_idx=[-1], target="cuda", **_compile_kw(impl, variant))
                    row["compile_cold_s"] = time.perf_counter() - t0
                    # with --warm-cache the first compile is the cached one (a second would only repeat it)
                    row["compile_cached_s"] = row["compile_cold_s"] if WARM else _cached_compile(tilelang, impl, func,
                                                                                                    [-1], variant)
                    c = k(a, b)
                    row["rel_err"] = ((c.float() - ref).norm() / ref.norm()).item()
                except Exception as e:
                    print(f"[{impl}] gemm {dtype} {M}x{N}x{K} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                group.append((row, functools.partial(k, a, b)))
            items.append(group)
    for b_, h, s_, d in _fa_shapes(False):
      for causal in (False, True):
        q, kk, v = (torch.randn(b_, h, s_, d, device="cuda", dtype=torch.float16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=causal)
        group = [({"impl": "sdpa", "kind": "fa", "causal": causal, "shape": [b_, h, s_, d]},
                  functools.partial(torch.nn.functional.scaled_dot_product_attention, q, kk, v, is_causal=causal))]
        for impl, stages in ab_fa:
            if impl in SKIP:
                continue
            row = {"impl": impl, "kind": "fa", "causal": causal, "shape": [b_, h, s_, d], "num_stages": stages}
            try:
                t0 = time.perf_counter()
                func = ck.flashattn_bhsd(b_, h, s_, d, causal, num_stages=stages)
                k = tilelang.compile(func, out_idx=[3], target="cuda", **_compile_kw(impl))
                row["compile_cold_s"] = time.perf_counter() - t0
                row["compile_cached_s"] = row["compile_cold_s"] if WARM else _cached_compile(tilelang, impl, func, [3])
                row["max_abs_err"] = (k(q, kk, v).float() - ref.float()).abs().max().item()
            except Exception as e:
                print(f"[{impl}] fa causal={causal}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            group.append((row, functools.partial(k, q, kk, v)))
        items.append(group)
    print(f"ab: built {sum(len(g) for g in items)} contenders", flush=True)

    def table_rows() -> list[dict]:
        rows = []
        for group in items:
            for row, _ in group:
                if not row.get("round_ms"):
                    continue
                ms = sorted(row["round_ms"])[len(row["round_ms"]) // 2]
                if row["kind"] == "gemm":
                    M, N, K = row["shape"]
                    flops = 2 * M * N * K
                else:
                    b_, h, s_, d = row["shape"]
                    flops = 4 * b_ * h * s_ * s_ * d * (0.5 if row["causal"] else 1.0)
                row.update({"ms": ms, "tflops": flops / ms / 1e9, "best": True})
                rows.append(row)
        return rows

    for r in range(rounds):
        for group in items:
            order = group[r % len(group):] + group[:r % len(group)]
            for row, fn in order:
                row.setdefault("round_ms", []).append(graph_time_ms(fn))
        if save is not None:  # a run cut short keeps the rounds it finished
            save(table_rows())
        print(f"ab: round {r + 1} done", flush=True)
    rows = table_rows()
    for row in rows:
        print(f"[{row['impl']}] {row['kind']} {row.get('dtype', '')} {row['shape']} {row.get('causal', '')} "
              f"{row.get('config', '')} {row.get('variant', '')}: {row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s "
              f"rounds {[round(x, 3) for x in row['round_ms']]}", flush=True)
    return rows


def _tune_cases():
    """(kind, tuner, args, kwargs, key) of every shape --tune tunes: the GEMMs (bf16; fp16 at 8192^3) and the
    flash attention shapes, full and causal."""
    sys.path.insert(0, str(HERE))
    import cuda_kernels as ck

    for dtype in _gemm_dtypes():
        for shape in GEMM_SHAPES:
            if dtype == "float16" and shape != GEMM_SHAPES[0]:
                continue
            yield "gemm", ck.gemm_nt_tuned, shape, {"dtype": dtype}, (dtype, shape)
    for shape in _fa_shapes(False):
        for causal in (False, True):
            yield "fa", ck.flashattn_bhsd_tuned[causal], shape, {}, (causal, shape)


def build_tune() -> int:
    """Compile (no GPU needed) every candidate --tune times: warms the caches for a --warm-cache run."""
    n = 0
    for kind, tuner, args, kw, key in _tune_cases():
        bad = [(c, e) for c, k, e in tuner.build_candidates(*args, **kw) if k is None]
        n += len(tuner.candidates(*args, **kw)) - len(bad)
        for c, e in bad:
            print(f"[tune build] {kind} {key} {c}: {e[:200]}", flush=True)
    print(f"build: {n} autotune candidates built", flush=True)
    return n


def run_tune(save=None) -> list[dict]:
    """The autotuned entry points of cuda_kernels.py tuned on this GPU, shape by shape: the config each picks
    (tuner.tune: every candidate checked against its reference and timed with do_bench), the candidates' times,
    then the pick and its peer (cuBLAS / SDPA) timed back to back with the graph timing of the other rows."""
    rows = []
    for kind, tuner, args, kw, key in _tune_cases():
        t0 = time.perf_counter()
        if TUNE_NO_CHECK:  # the candidates' outputs are not compared during tuning (the pick's error is, below)
            tuner.ref_prog = None
        try:
            k = tuner.tune(*args, **kw)
        except Exception as e:  # a shape whose candidates all fail is reported, not fatal
            print(f"[tune] {kind} {key}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append({"impl": "ours_tuned", "kind": kind, "shape": list(args), "error": str(e)[:300]})
            continue
        res = tuner.last_result
        row = {"impl": "ours_tuned", "kind": kind, "shape": list(args), "config": res.config,
               "candidates_do_bench_ms": res.timings, "tune_s": time.perf_counter() - t0}
        if kind == "gemm":
            M, N, K = args
            tdt = getattr(torch, kw["dtype"])
            a, b = torch.randn(M, K, device="cuda", dtype=tdt), torch.randn(N, K, device="cuda", dtype=tdt)
            ref = a.float() @ b.float().T
            row["dtype"] = kw["dtype"]
            row["rel_err"] = ((k(a, b).float() - ref).norm() / ref.norm()).item()
            ours, peer = functools.partial(k, a, b), functools.partial(torch.matmul, a, b.T)
            flops = 2 * M * N * K
        else:
            causal, (b_, h, s_, d) = key
            q, kk, v = (torch.randn(b_, h, s_, d, device="cuda", dtype=torch.float16) for _ in range(3))
            ref = torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=causal)
            row["causal"] = causal
            row["max_abs_err"] = (k(q, kk, v).float() - ref.float()).abs().max().item()
            ours = functools.partial(k, q, kk, v)
            peer = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, kk, v, is_causal=causal)
            flops = 4 * b_ * h * s_ * s_ * d * (0.5 if causal else 1.0)
        row["ms"], row["peer_ms"] = graph_time_ms(ours), graph_time_ms(peer)
        row["tflops"], row["peer_tflops"] = flops / row["ms"] / 1e9, flops / row["peer_ms"] / 1e9
        row["ratio_vs_peer"] = row["peer_ms"] / row["ms"]
        print(f"[tune] {kind} {key}: picked {res.config} in {row['tune_s']:.1f} s; {row['tflops']:.0f} TFLOP/s = "
              f"{row['ratio_vs_peer']:.3f}x the peer; candidates (do_bench ms) {res.timings}", flush=True)
        rows.append(row)
        if save is not None:
            save(rows)
    return rows


def run_peers(quick: bool) -> list[dict]:
    rows = []
    shapes = GEMM_SHAPES[:2] if quick else GEMM_SHAPES
    for dtype in _gemm_dtypes():
        tdt = getattr(torch, dtype)
        for M, N, K in shapes:
            if dtype == "float16" and (M, N, K) != GEMM_SHAPES[0]:
                continue
            a = torch.randn(M, K, device="cuda", dtype=tdt)
            b = torch.randn(N, K, device="cuda", dtype=tdt)
            ms = graph_time_ms(functools.partial(torch.matmul, a, b.T))
            rows.append({"impl": "cublas", "kind": "gemm", "dtype": dtype, "shape": [M, N, K], "ms": ms,
                         "tflops": 2 * M * N * K / ms / 1e9, "best": True})
            print(f"[cublas] gemm {dtype} {M}x{N}x{K}: {ms:.3f} ms {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
    for b_, h, s, d in _fa_shapes(quick):
      for causal in (False, True):
        q, kk, v = (torch.randn(b_, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
        ms = graph_time_ms(functools.partial(torch.nn.functional.scaled_dot_product_attention, q, kk, v, is_causal=causal))
        flops = 4 * b_ * h * s * s * d * (0.5 if causal else 1.0)
        rows.append({"impl": "sdpa", "kind": "fa", "causal": causal, "shape": [b_, h, s, d], "ms": ms,
                     "tflops": flops / ms / 1e9, "best": True})
        print(f"[sdpa] fa causal={causal}: {ms:.3f} ms {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
    return rows


def summarize(rows: list[dict]) -> list[str]:
    """One line per kernel: ours (TMA default), ours warp-specialized, cp.async, mma.sync, the peer, the public
    TileLang; "best" = the faster of ours and ours_ws (both are this tilelang on the same source)."""
    def key(r):
        return (r["kind"], r.get("dtype"), tuple(r.get("shape", [])), r.get("causal"))

    best = {}
    for r in rows:  # the fastest row per (impl, kernel): an impl may run several configurations (FA stages)
        if r.get("best") and "tflops" in r:
            old = best.get((r["impl"], *key(r)))
            if old is None or r["tflops"] > old["tflops"]:
                best[(r["impl"], *key(r))] = r
    lines = ["| kernel | ours (wgmma + TMA) TFLOP/s | ours warp-specialized | ours WS + overlap | ours WS + overlap + "
             "pingpong | ours WS + persistent | ours WS + multicast | ours WS + pingpong | ours WS + pingpong + persistent | ours cp.async | ours mma.sync | "
             "peer (cuBLAS/SDPA) | best/peer | public TileLang | best/public | best: compile cold / cached | best config | "
             "best session-27 form |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    kernels = sorted({tuple(k) for (impl, *k) in best if impl.startswith("ours")}, key=str)

    def t(r):
        return f"{r['tflops']:.0f}" if r else "-"

    for k in kernels:
        mine = {i: best.get((i, *k)) for i in ("ours", "ours_tma", "ours_ws", "ours_nov", "ours_ov", "ours_ovpp",
                                                  "ours_wsp", "ours_wsm", "ours_pp", "ours_ppp", "ours_cp", "ours_mma",
                                                  *S27_IMPLS)}
        mine["ours"] = mine["ours"] or mine["ours_tma"]
        top = max((r for i, r in mine.items() if i in ("ours", "ours_ws", "ours_nov", "ours_ov", "ours_ovpp", "ours_wsp",
                                                         "ours_wsm", "ours_pp", "ours_ppp", *S27_IMPLS) and r),
                  key=lambda r: r["tflops"], default=None)
        s27 = max((r for i, r in mine.items() if i in S27_IMPLS and r), key=lambda r: r["tflops"], default=None)
        if top is None:
            continue
        peer = best.get(("cublas" if k[0] == "gemm" else "sdpa", *k))
        pub = best.get(("public", *k))
        name = (f"gemm {k[1]} {'x'.join(map(str, k[2]))}" if k[0] == "gemm" else
                f"fa fp16 {'x'.join(map(str, k[2]))} {'causal' if k[3] else 'full'}")
        ratio = f"{top['tflops'] / peer['tflops']:.2f}x" if peer else "-"
        pratio = f"{top['tflops'] / pub['tflops']:.2f}x" if pub else "-"
        stages = f" {top['num_stages']} stages" if "num_stages" in top else ""
        lines.append(f"| {name} | {t(mine['ours'])} | {t(mine['ours_ws'] or mine['ours_nov'])} | {t(mine['ours_ov'])} | "
                     f"{t(mine['ours_ovpp'])} | {t(mine['ours_wsp'])} | "
                     f"{t(mine['ours_wsm'])} | "
                     f"{t(mine['ours_pp'])} | {t(mine['ours_ppp'])} | {t(mine['ours_cp'])} | "
                     f"{t(mine['ours_mma'])} | {t(peer)} | {ratio} | {t(pub)} | {pratio} | "
                     f"{top['compile_cold_s']:.2f} s / {top['compile_cached_s'] * 1e3:.1f} ms | "
                     f"{top['impl']} {'x'.join(map(str, top.get('config', []))) or '-'} {top.get('variant', '')}{stages} | "
                     + (f"{s27['impl']}{' ' + str(s27['num_stages']) + ' st.' if 'num_stages' in s27 else ''} "
                        f"{s27['tflops']:.0f} |" if s27 else "- |"))
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = [r for r in rows if r.get("best") and "tflops" in r]
    keys = []
    for r in best:
        k = (r["kind"], r.get("dtype"), tuple(r.get("shape", [])), r.get("causal"))
        if k not in keys:
            keys.append(k)
    impls = ["ours", "ours_tma", "ours_ws", "ours_nov", "ours_ov", "ours_ovpp", "ours_wsp", "ours_wsm", "ours_pp", "ours_ppp", "ours_cp", "ours_mma",
             *S27_IMPLS, "public", "cublas", "sdpa"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.14
    for i, impl in enumerate(impls):
        vals = []
        for k in keys:
            m = [r for r in best if r["impl"] == impl and (r["kind"], r.get("dtype"), tuple(r.get("shape", [])),
                                                            r.get("causal")) == k]
            vals.append(m[0]["tflops"] if m else 0)
        if any(vals):
            ax.bar([j + i * width for j in range(len(keys))], vals, width, label=impl)
    short = {"float16": "fp16", "bfloat16": "bf16"}
    labels = [(f"{short.get(k[1], k[1])} {'x'.join(map(str, k[2]))}" if k[0] == "gemm" else
               f"FA s{k[2][2]} {'causal' if k[3] else 'full'}")
              for k in keys]
    ax.set_xticks([j + 2.5 * width for j in range(len(keys))], labels, rotation=20, fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("tilelang CUDA backend (wgmma + TMA; warp-specialized; cp.async; mma.sync) vs public TileLang 0.1.15, "
                 "cuBLAS, SDPA — H200, "
                 + time.strftime("%Y-%m-%d"))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def compile_only(out: str | None) -> None:
    """No GPU needed: cold and cached compile times of the benchmark kernels (NVRTC, sm_90a)."""
    import platform

    sys.path.insert(0, str(HERE))
    import cuda_kernels as ck
    import tilelang

    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TILESTACK_CACHE_DIR"] = cache
        cases = [(f"gemm_nt bf16 8192^3 {cfg}", lambda cfg=cfg: ck.gemm_nt(8192, 8192, 8192, *cfg[:5], "bfloat16"),
                  [-1])
                 for cfg in GEMM_CONFIGS[(8192, 8192, 8192)]]
        cases += [(f"flashattn_bhsd fp16 b4 h32 s4096 d128 causal={c}",
                   lambda c=c: ck.flashattn_bhsd(*FA_SHAPE, c), [3]) for c in (False, True)]
        for name, make, out_idx in cases:
            t0 = time.perf_counter()
            func = make()
            k = tilelang.compile(func, out_idx=out_idx, target="cuda")
            cold = time.perf_counter() - t0
            cached = _cached_compile(tilelang, "ours", func, out_idx)
            t0 = time.perf_counter()
            k2 = tilelang.compile(func, out_idx=out_idx, target="cuda")
            memo = time.perf_counter() - t0
            regs = [ln.strip() for ln in k._impl.module.log.splitlines() if "registers" in ln]
            rows.append({"kernel": name, "compile_cold_s": cold, "compile_cached_s": cached, "compile_memo_s": memo,
                         "cache_hit_second": k2.cache_hit, "smem_bytes": k._impl.kernels[0][2], "ptxas": regs})
            print(f"{name}: cold {cold:.2f} s, cached {cached * 1e3:.1f} ms (same prim_func again: "
                  f"{memo * 1e6:.0f} us), smem {k._impl.kernels[0][2]} B", flush=True)
    if out:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} CPUs, shared)",
                "what": "tilelang.compile(target='cuda') wall time without a GPU: cold = parse + lower + NVRTC "
                        "(empty cache); cached = a new JITKernel of the same prim_func (lower + codegen + "
                        "disk-cached cubin); memo = tilelang.compile of the same prim_func again (in-process)"}
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "tilelang_cuda_compile.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="ours", choices=["ours", "public"])
    ap.add_argument("--public", default=None, help="folder of the unpacked public TileLang bundle (e.g. /tmp/ptl)")
    ap.add_argument("--out", default=None, help="directory for the JSON and the plot")
    ap.add_argument("--json", default=None, help="(child) write rows here")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile-only", action="store_true", help="no GPU: time cold/cached compiles only")
    ap.add_argument("--skip-ws", action="store_true", help="leave out the ours_ws rows (cuda_warp_specialize)")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                    help="time the AB_GEMM / AB_FA candidates and the peers interleaved over ROUNDS rounds (only)")
    ap.add_argument("--with-wsp", action="store_true", help="add the ours_wsp rows (warp-specialized + persistent)")
    ap.add_argument("--with-pp", action="store_true", help="add the ours_pp flash-attention rows (WS + pingpong)")
    ap.add_argument("--with-cp", action="store_true", help="add the ours_cp rows (copies on cp.async)")
    ap.add_argument("--short", action="store_true", help="the short configuration lists (SHORT_CONFIGS)")
    ap.add_argument("--only", choices=["gemm", "fa"], default=None, help="time only the GEMMs or only flash attention")
    ap.add_argument("--skip", default="", help="comma-separated --ab contenders to leave out (ours_wsm,ours_ov,...)")
    ap.add_argument("--go-file", default=None, help="(child) precompile, then wait for this file before timing")
    ap.add_argument("--public-early", action="store_true",
                    help="start the public TileLang's child first: it compiles while ours runs, times after")
    ap.add_argument("--public-wait", nargs=2, metavar=("GO", "JSON"), default=None,
                    help="a public child started earlier (--impl public --go-file GO --json JSON): after ours, create "
                         "GO and merge JSON once it is written")
    ap.add_argument("--best-from", default=None, help="JSON of an earlier run: time only its best config per shape")
    ap.add_argument("--skip-mma", action="store_true", help="leave out the ours_mma rows (mma.sync + cp.async)")
    ap.add_argument("--set", dest="ab_set", choices=sorted(AB_SETS), default="s26",
                    help="--ab's contenders: s26 (AB_GEMM / AB_FA) or s27 (the session-27 opt-in forms)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="--ab / --tune: compile into $TILESTACK_CACHE_DIR (a cache warmed by --build-only) instead of "
                         "an empty one (the compile columns then measure cache hits)")
    ap.add_argument("--build-only", action="store_true",
                    help="no GPU: build every contender of --ab's --set (and with --tune every autotune candidate) "
                         "into $TILESTACK_CACHE_DIR, time nothing")
    ap.add_argument("--tune", action="store_true",
                    help="tune cuda_kernels.gemm_nt_tuned / flashattn_bhsd_tuned per shape (after --ab if both)")
    ap.add_argument("--replays", type=int, default=5, help="timed replays of each CUDA graph of 10 calls (median)")
    ap.add_argument("--tune-no-check", action="store_true",
                    help="--tune: skip the autotuner's per-candidate reference check (the pick's error is still "
                         "measured); its random inputs and the float64 comparison cost seconds per large candidate")
    args = ap.parse_args()
    global SHORT, ONLY, REPLAYS, TUNE_NO_CHECK, WARM
    REPLAYS = args.replays
    WARM = args.warm_cache
    TUNE_NO_CHECK = args.tune_no_check
    SHORT = args.short
    ONLY = args.only
    SKIP.update(x for x in args.skip.split(",") if x)
    if args.best_from:
        load_best(args.best_from)
    if args.compile_only:
        compile_only(args.out)
        return
    if args.build_only:
        if args.ab:
            build_ab(args.ab_set)
        if args.tune:
            build_tune()
        return
    if args.impl == "public":
        pre = precompile("public", args.quick, args.go_file) if args.go_file else None
        rows = run_impl("public", args.quick, pre)
        Path(args.json + ".part").write_text(json.dumps(rows))
        os.replace(args.json + ".part", args.json)  # the parent polls for the file: it appears whole
        return
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": torch.cuda.get_device_name(),
            "torch": torch.__version__, "timing": "CUDA graph of 10 calls, median of 5 replays"}

    def save(rows: list[dict]) -> list[str]:  # after every stage: a run cut short keeps what it measured
        table = summarize(rows)
        if args.out:
            outdir = Path(args.out)
            outdir.mkdir(parents=True, exist_ok=True)
            (outdir / "tilelang_cuda.json").write_text(json.dumps({"meta": meta, "rows": rows, "table": table},
                                                                  indent=1))
        return table

    child = None
    if args.public:
        tmp = Path(tempfile.mkdtemp())
        out, go = tmp / "public.json", tmp / "go"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = args.public
        cmd = [sys.executable, __file__, "--impl", "public", "--json", str(out)] + (["--quick"] if args.quick else []) + (
            ["--only", args.only] if args.only else [])
        if args.public_early:
            cmd += ["--go-file", str(go)]
            child = subprocess.Popen(cmd, env=env)
    rows = [] if args.ab or args.tune else run_peers(args.quick)
    if not (args.ab or args.tune):
        save(rows)

    def merge_public_wait() -> None:
        go_path, json_path = map(Path, args.public_wait)
        go_path.write_text("go")
        t0 = time.perf_counter()
        limit = float(os.environ.get("BENCH_PUBLIC_WAIT_S", "120"))
        while not json_path.exists() and time.perf_counter() - t0 < limit:
            time.sleep(0.1)
        if json_path.exists():
            rows.extend(json.loads(json_path.read_text()))
        else:
            print("public TileLang rows never came", flush=True)
        save(rows)

    if args.ab or args.tune:
        rows = []
        with tempfile.TemporaryDirectory() as cache:
            if not args.warm_cache:
                os.environ["TILESTACK_CACHE_DIR"] = cache
            if args.ab:
                meta["timing"] += f"; --ab: contenders of a kernel back to back, {args.ab} rounds, median; --set {args.ab_set}"
                rows = run_ab(args.ab, save, args.ab_set)
            if args.tune:  # the autotuner's picks, after the interleaved rounds (their rows: impl ours_tuned)
                rows += run_tune(lambda tuned: save(rows + tuned))
        if args.public_wait:  # the public TileLang child times after our rounds
            merge_public_wait()
        table = save(rows)
        print("\n".join(table))
        if args.out:
            try:
                plot(rows, Path(args.out) / "tilelang_cuda.png")
            except Exception as e:
                print(f"no plot: {e}")
        return
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TILESTACK_CACHE_DIR"] = cache  # cold compiles really are cold
        rows += run_impl("ours", args.quick)
        save(rows)
        if args.public_wait:  # the public TileLang times now, before the experimental forms run
            merge_public_wait()
        if not args.skip_ws:
            rows += run_impl("ours_ws", args.quick)
            save(rows)
        if args.with_wsp:
            rows += run_impl("ours_wsp", args.quick)
            save(rows)
        if args.with_pp:
            rows += run_impl("ours_pp", args.quick)
            save(rows)
            rows += run_impl("ours_ppp", args.quick)
            save(rows)
        if args.with_cp:
            rows += run_impl("ours_cp", args.quick)
            save(rows)
        if not args.skip_mma:
            rows += run_impl("ours_mma", args.quick)
            save(rows)
    if args.public:
        if child is not None:
            go.write_text("go")
            rc = child.wait(timeout=900)
        else:
            rc = subprocess.run(cmd, env=env, timeout=900).returncode
        if rc == 0 and out.exists():
            rows += json.loads(out.read_text())
        else:
            print(f"public TileLang run failed (rc {rc})", flush=True)
    table = save(rows)
    print("\n".join(table))
    if args.out:
        try:
            plot(rows, Path(args.out) / "tilelang_cuda.png")
        except Exception as e:  # matplotlib may be missing on the GPU machine
            print(f"no plot: {e}")


if __name__ == "__main__":
    main()
