# requires: cuda
"""One launch per deepgemm kernel family (and its cuBLAS peer), for an ncu summary; and the
promotion / epilogue share of the time, measured by leaving each stage out.

    # compile everything first (parallel, no GPU work), then profile one launch of each case:
    python packages/deepgemm/benchmarks/profile_ncu.py --compile --jobs 8
    ncu --clock-control none -k regex:'gemm_sm90|nvjet|xmma|cutlass' --launch-count 16 \
        --section SpeedOfLight ... -o OUT/deepgemm_ncu python packages/deepgemm/benchmarks/profile_ncu.py --launch
    # stage shares (tilehal.bench, L2 flushed, and CUDA-graph replay):
    python packages/deepgemm/benchmarks/profile_ncu.py --shares --out OUT

The stage-less variants are compiled with -DDEEPGEMM_PROFILE_SKIP_PROMOTION / _SKIP_EPILOGUE
(kernels/gemm_sm90.cuh): their results are wrong, only their time is used.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import json
from pathlib import Path

import deepgemm
import tilehal
import torch
from deepgemm import cuda_gemm
from deepgemm.heuristics import pick_config
from deepgemm.utils import ceil_div

# (name, kind, grouping, m, n, k, groups): M x N x K per group; contiguous m is M_sum
CASES = [
    ("dense_fp8_4096x4096x7168", "fp8", "normal", 4096, 4096, 7168, 1),
    ("dense_bf16_4096x4096x7168", "bf16", "normal", 4096, 4096, 7168, 1),
    ("contig_fp8_4x8192x4096x7168", "fp8", "contiguous", 4 * 8192, 4096, 7168, 4),
    ("masked_fp8_1x1024x4096x7168", "fp8", "masked", 1024, 4096, 7168, 1),
    ("masked_fp8_1x1024x7168x2048", "fp8", "masked", 1024, 7168, 2048, 1),
    ("small_fp8_128x4096x7168", "fp8", "normal", 128, 4096, 7168, 1),
    ("small_fp8_64x2112x7168", "fp8", "normal", 64, 2112, 7168, 1),
    ("small_bf16_128x2112x7168", "bf16", "normal", 128, 2112, 7168, 1),
]
SHARE_CASES = ("dense_fp8_4096x4096x7168", "contig_fp8_4x8192x4096x7168", "masked_fp8_1x1024x7168x2048",
               "dense_bf16_4096x4096x7168", "small_fp8_128x4096x7168")
FP4_NK = [(7168, 2048), (2112, 7168), (4096, 7168)]  # the FP4-weight target shapes (issue 19)
FP4_M = (1, 16, 64, 128)
SKIP = {"promotion": ("-DDEEPGEMM_PROFILE_SKIP_PROMOTION",), "epilogue": ("-DDEEPGEMM_PROFILE_SKIP_EPILOGUE",)}


def key_of(case, num_sms=132):
    _, kind, grouping, m, n, k, g = case
    tma = grouping != "masked"
    cfg = pick_config(kind, m, n, k, num_groups=g, grouping=grouping, num_sms=num_sms, tma_store=tma,
                      staged_store=cuda_gemm.staged_store(torch.bfloat16, n, False, tma))
    return cuda_gemm.kernel_key(cfg, n, k, grouping, g, torch.bfloat16, False), cfg


def _compile(args):
    key, opts = args
    cuda_gemm.compile_kernel(key, opts)
    return key.expression


def compile_all(jobs: int) -> None:
    work = []
    for case in CASES:
        key, _ = key_of(case)
        work.append((key, ()))
        if case[0] in SHARE_CASES:
            for opts in SKIP.values():
                if opts == SKIP["promotion"] and case[1] != "fp8":
                    continue
                work.append((key, opts))
    for m in FP4_M:
        for n, k in FP4_NK:
            work.append((key_of(("", "fp8", "normal", m, n, k, 1))[0], ()))
    with cf.ProcessPoolExecutor(jobs) as ex:
        for expr in ex.map(_compile, work):
            print("compiled", expr[:90], flush=True)


def make(case):
    """Inputs and two callables (ours, peer or None) for one case."""
    name, kind, grouping, m, n, k, g = case
    dev = "cuda"
    if kind == "bf16":
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        return (lambda: deepgemm.bf16_gemm_nt(a, b, d)), (lambda: torch.matmul(a, b.T))
    if grouping == "normal":
        a8, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
        b8, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(n, k, device=dev, dtype=torch.bfloat16))
        sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
        d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        one_a, one_b = torch.ones(m, 1, device=dev), torch.ones(1, n, device=dev)
        return ((lambda: deepgemm.fp8_gemm_nt((a8, sfa), (b8, sfb), d)),
                (lambda: torch._scaled_mm(a8, b8.T, scale_a=one_a, scale_b=one_b, out_dtype=torch.bfloat16)))
    b8 = torch.empty(g, n, k, device=dev, dtype=torch.float8_e4m3fn)
    sfb = torch.empty(g, ceil_div(n, 128), ceil_div(k, 128), device=dev)
    for i in range(g):
        b8[i], sfb[i] = deepgemm.per_block_cast_to_fp8(torch.randn(n, k, device=dev, dtype=torch.bfloat16))
    if grouping == "contiguous":
        a8, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
        sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
        idx = torch.arange(m, device=dev, dtype=torch.int32) // (m // g)
        d = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        _OUTPUTS.append(d)
        return (lambda: deepgemm.m_grouped_fp8_gemm_nt_contiguous((a8, sfa), (b8, sfb), d, idx)), None
    a = torch.randn(g, m, k, device=dev, dtype=torch.bfloat16)
    a8 = torch.empty(g, m, k, device=dev, dtype=torch.float8_e4m3fn)
    sfa = torch.empty(g, m, ceil_div(k, 128), device=dev)
    for i in range(g):
        a8[i], sfa[i] = deepgemm.per_token_cast_to_fp8(a[i])
    sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    masked = torch.full((g,), m, device=dev, dtype=torch.int32)
    d = torch.empty(g, m, n, device=dev, dtype=torch.bfloat16)
    return (lambda: deepgemm.m_grouped_fp8_gemm_nt_masked((a8, sfa), (b8, sfb), d, masked, m)), None


def launch_once() -> None:
    """Every case's kernel once, then every peer once (what ncu profiles)."""
    made = [(case, *make(case)) for case in CASES]
    torch.cuda.synchronize()
    for case, ours, _ in made:
        print("launch", case[0], key_of(case)[0].expression, flush=True)
        ours()
        torch.cuda.synchronize()
    for case, _, peer in made:
        if peer is not None:
            print("launch peer", case[0], flush=True)
            peer()
            torch.cuda.synchronize()


class _Patched:
    """cuda_gemm._kernel compiled with extra options while active (profiling variants only)."""

    def __init__(self, opts):
        self.opts, self.cache = opts, {}

    def __enter__(self):
        self.orig = cuda_gemm._kernel

        def k(key):
            if key not in self.cache:
                self.cache[key] = cuda_gemm.compile_kernel(key, self.opts).get_kernel(key.expression)
            return self.cache[key]

        cuda_gemm._kernel = k

    def __exit__(self, *exc):
        cuda_gemm._kernel = self.orig


def _write(out: Path | None, name: str, rows: list[dict], timing: str | None = None) -> None:
    """rows as out/name (JSON: date, device, torch, timing when given, rows); nothing without out."""
    if out is None:
        return
    doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if timing is not None:
        doc["timing"] = timing
    doc["rows"] = rows
    (out / name).write_text(json.dumps(doc, indent=1))


def shares(out: Path | None, only: str | None = None) -> list[dict]:
    rows = []
    for case in CASES:
        if case[0] not in SHARE_CASES or (only and only not in case[0]):
            continue
        ours, _ = make(case)
        _, kind, grouping, m, n, k, g = case
        flops = 2 * m * n * k * (g if grouping == "masked" else 1)
        r = {"case": case[0], "config": str(key_of(case)[1])}
        variants = [("full", ())] + [(f"no_{s}", o) for s, o in SKIP.items() if not (s == "promotion" and kind != "fp8")]
        for label, opts in variants:
            with _Patched(opts):
                ours()
                torch.cuda.synchronize()
                t = tilehal.bench(ours, warmup=3, iters=20, flush_l2=True).median_s
                tg = tilehal.bench_graph(ours, warmup=3, iters=20, flush_l2=True).median_s
            r[f"{label}_us"], r[f"{label}_graph_us"] = t * 1e6, tg * 1e6
            r[f"{label}_tflops"] = flops / t / 1e12
        for label, _ in variants[1:]:
            r[f"{label}_saves_pct"] = 100 * (1 - r[f"{label}_us"] / r["full_us"])
        print(json.dumps(r), flush=True)
        rows.append(r)
    _write(out, "deepgemm_stage_shares.json", rows,
           timing="tilehal.bench median of 20, L2 flushed; *_graph_us: CUDA-graph replay, L2 flushed")
    return rows


def decode_peers(out: Path | None) -> list[dict]:
    """The FP4 targets' peers: cuBLAS bf16 and deepgemm fp8 at M in FP4_M, (N, K) in FP4_NK."""
    rows = []
    for n, k in FP4_NK:
        for m in FP4_M:
            case = ("", "fp8", "normal", m, n, k, 1)
            fp8, _ = make(case)
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            r = {"m": m, "n": n, "k": k}
            for label, fn in (("cublas_bf16", lambda a=a, b=b: torch.matmul(a, b.T)), ("deepgemm_fp8", fp8)):
                r[f"{label}_us"] = tilehal.bench(fn, warmup=3, iters=30, flush_l2=True).median_s * 1e6
                r[f"{label}_graph_us"] = tilehal.bench_graph(fn, warmup=3, iters=30, flush_l2=True).median_s * 1e6
            print(json.dumps(r), flush=True)
            rows.append(r)
    _write(out, "deepgemm_decode_peers.json", rows,
           timing="tilehal.bench median of 30, L2 flushed; *_graph_us: CUDA-graph replay, L2 flushed")
    return rows


def contig_overlap_ab(out: Path | None) -> list[dict]:
    """A/B: the contiguous grouped fp8 kernel with the overlapped promotion forced on (24-register producer)
    vs the serial path the heuristic keeps (wait_group 0 per K block), same tile, same run."""
    from deepgemm import heuristics

    rows = []
    for g, rows_per, n, k in ((4, 8192, 4096, 7168), (8, 4096, 7168, 2048)):
        case = ("", "fp8", "contiguous", g * rows_per, n, k, g)
        ours, _ = make(case)
        d = None
        res = {"shape": [g, rows_per, n, k]}
        orig = heuristics.overlaps
        for label, allow in (("serial", False), ("overlapped", True)):
            heuristics.overlaps = (lambda kind, bn, grouping="normal": kind == "fp8" and (
                bn <= heuristics.OVERLAP_MAX_STRADDLING_N or bn == heuristics.OVERLAP_MAX_BLOCK_N)) if allow else \
                (lambda kind, bn, grouping="normal": False)
            try:
                ours()
                torch.cuda.synchronize()
                out_d = [t for t in _last_outputs()]
                t = tilehal.bench(ours, warmup=3, iters=20, flush_l2=True).median_s
                tg = tilehal.bench_graph(ours, warmup=3, iters=20, flush_l2=True).median_s
            finally:
                heuristics.overlaps = orig
            res[f"{label}_us"], res[f"{label}_graph_us"] = t * 1e6, tg * 1e6
            res[f"{label}_tflops"] = 2 * g * rows_per * n * k / t / 1e12
            if d is None:
                d = out_d[0].clone()
            else:
                res["identical_results"] = bool(torch.equal(d, out_d[0]))
        print(json.dumps(res), flush=True)
        rows.append(res)
    _write(out, "deepgemm_contig_overlap_ab.json", rows)
    return rows


_OUTPUTS: list[torch.Tensor] = []


def _last_outputs() -> list[torch.Tensor]:
    return _OUTPUTS[-1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--launch", action="store_true")
    ap.add_argument("--shares", action="store_true")
    ap.add_argument("--decode-peers", action="store_true")
    ap.add_argument("--contig-overlap", action="store_true")
    ap.add_argument("--only", default=None, help="--shares: only the cases whose name contains this")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.compile:
        compile_all(args.jobs)
    if args.launch:
        launch_once()
    if args.shares:
        shares(args.out, args.only)
    if args.decode_peers:
        decode_peers(args.out)
    if args.contig_overlap:
        contig_overlap_ab(args.out)


if __name__ == "__main__":
    main()
