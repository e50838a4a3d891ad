"""Check and time single kernels of bench_cuda.py on the GPU, with T.gemm on wgmma (the sm_90a
default) and on mma.sync (pass_configs {"tl.disable_wgmma": True}); also the driver `ncu` profiles.

    python cuda_probe.py check [--only gemm|fa] [--json out.json]   # correctness vs torch + timing, both paths
    python cuda_probe.py warm [--jobs 16]                            # fill the compile cache in parallel (no GPU)
    python cuda_probe.py ncu KERNEL...                               # run each kernel once (for ncu -k / -c)

KERNEL: gemm16_wgmma, gemm16_mma, fa_wgmma, fa_mma (fp16 GEMM NT 8192^3 128x256x64 3 stages 256 threads;
flash attention fwd bhsd b4 h32 s4096 d128 non-causal). Timing as bench_cuda.py (CUDA graph of 10 calls,
median of 5 replays). Nothing asserts a time; a wrong result is printed as such and the exit code is 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cuda_kernels as ck  # noqa: E402
import tilelang  # noqa: E402
from bench_cuda import graph_time_ms  # noqa: E402

NO_WGMMA = {"tl.disable_wgmma": True, "tl.disable_tma_lower": True}  # the sm_80-style path: mma.sync + cp.async
GEMM_CASES = [("float16", (8192, 8192, 8192), (128, 256, 64, 3, 256)),
              ("bfloat16", (4096, 7168, 2048), (128, 256, 64, 3, 256)),
              ("bfloat16", (4096, 2112, 7168), (128, 128, 64, 3, 256)),
              ("bfloat16", (4096, 24576, 1536), (128, 256, 64, 3, 256))]


def build(kind: str, path: str, causal: bool = False, dtype: str = "float16", shape=(8192, 8192, 8192),
          cfg=(128, 256, 64, 3, 256)):
    """path: "mma" (mma.sync + cp.async), "wgmma" (the defaults) or a bench_cuda impl suffix (tma, ws, wsp,
    pp, ppp, ov, ovpp, wsm, and session 27's sp, ovsp, ovppsp, ppsp, two: bench_cuda._pass_configs("ours_" + path)),
    for flash attention optionally followed by its number of stages."""
    from bench_cuda import _pass_configs

    stages = 2  # flash attention: a trailing digit of `path` is its num_stages (ovpp3: overlap + pingpong, 3)
    if path[-1].isdigit():
        path, stages = path[:-1], int(path[-1])
    cfgs = NO_WGMMA if path == "mma" else None if path == "wgmma" else _pass_configs("ours_" + path)
    t0 = time.perf_counter()
    if kind == "gemm":
        M, N, K = shape
        k = tilelang.compile(ck.gemm_nt(M, N, K, *cfg, dtype), out_idx=[-1], target="cuda", pass_configs=cfgs)
    else:
        k = tilelang.compile(ck.flashattn_bhsd(4, 32, 4096, 128, causal, num_stages=stages), out_idx=[3],
                             target="cuda", pass_configs=cfgs)
    return k, time.perf_counter() - t0


def check(only: str | None, out: str | None) -> int:
    rows, bad = [], 0
    if only in (None, "gemm"):
        for dtype, shape, cfg in GEMM_CASES:
            M, N, K = shape
            tdt = getattr(torch, dtype)
            a = torch.randn(M, K, device="cuda", dtype=tdt)
            b = torch.randn(N, K, device="cuda", dtype=tdt)
            ref = a.float() @ b.float().T
            peer = graph_time_ms(functools.partial(torch.matmul, a, b.T))
            for path in ("mma", "wgmma"):
                try:
                    k, secs = build("gemm", path, dtype=dtype, shape=shape, cfg=cfg)
                    c = k(a, b)
                    err = ((c.float() - ref).norm() / ref.norm()).item()
                    ms = graph_time_ms(functools.partial(k, a, b))
                except Exception as e:  # report and go on: one failing path must not hide the others
                    print(f"gemm {dtype} {shape} {path}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                    bad += 1
                    continue
                ok = err < 1e-2
                bad += not ok
                tf = 2 * M * N * K / ms / 1e9
                rows.append({"kind": "gemm", "dtype": dtype, "shape": list(shape), "config": list(cfg), "path": path,
                             "ms": ms, "tflops": tf, "rel_err": err, "cublas_ms": peer,
                             "vs_cublas": peer / ms, "compile_s": secs})
                print(f"gemm {dtype} {M}x{N}x{K} {cfg} {path}: {ms:.3f} ms {tf:.0f} TFLOP/s = {peer / ms:.2f}x cuBLAS "
                      f"({peer:.3f} ms) err {err:.1e} {'OK' if ok else 'WRONG'} compile {secs:.2f}s", flush=True)
    if only in (None, "fa"):
        for causal in (False, True):
            q, kk, v = (torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.float16) for _ in range(3))
            ref = torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=causal)
            peer = graph_time_ms(functools.partial(torch.nn.functional.scaled_dot_product_attention, q, kk, v,
                                                   is_causal=causal))
            for path in ("mma", "wgmma"):
                try:
                    k, secs = build("fa", path, causal=causal)
                    o = k(q, kk, v)
                    err = (o.float() - ref.float()).abs().max().item()
                    ms = graph_time_ms(functools.partial(k, q, kk, v))
                except Exception as e:
                    print(f"fa causal={causal} {path}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                    bad += 1
                    continue
                ok = err < 2e-2
                bad += not ok
                tf = 4 * 4 * 32 * 4096 * 4096 * 128 * (0.5 if causal else 1.0) / ms / 1e9
                rows.append({"kind": "fa", "causal": causal, "path": path, "ms": ms, "tflops": tf, "max_abs_err": err,
                             "sdpa_ms": peer, "vs_sdpa": peer / ms, "compile_s": secs})
                print(f"fa causal={causal} {path}: {ms:.3f} ms {tf:.0f} TFLOP/s = {peer / ms:.2f}x SDPA ({peer:.3f} ms) "
                      f"err {err:.1e} {'OK' if ok else 'WRONG'} compile {secs:.2f}s", flush=True)
    if out:
        meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": torch.cuda.get_device_name(),
                "torch": torch.__version__, "timing": "CUDA graph of 10 calls, median of 5 replays"}
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 1 if bad else 0


def _warm_one(job: tuple) -> str:
    what, args = job
    t0 = time.perf_counter()
    try:
        if what == "variant":
            sys.path.insert(0, str(HERE.parent / "tests"))
            import test_cuda as tc

            name, cfgs = args
            tilelang.compile(tc._gemm_program(*tc.GEMM_VARIANTS[name]), out_idx=[2], target="cuda", pass_configs=cfgs)
        elif what == "public":
            sys.path.insert(0, str(HERE.parent / "tests"))
            import test_cuda as tc

            fac, fargs, *_ = tc.GPU[args]
            tc._compile(fac, fargs, "cuda")
        else:
            build(*args)
    except Exception as e:  # the real run reports it
        return f"{what} {args}: {type(e).__name__}: {str(e)[:200]}"
    return f"{what} {args}: {time.perf_counter() - t0:.2f}s"


def warm(jobs: int) -> None:
    """Fill the disk cache (NVRTC needs no GPU) in parallel processes before the timed runs."""
    from concurrent.futures import ProcessPoolExecutor

    sys.path.insert(0, str(HERE.parent / "tests"))
    import test_cuda as tc

    work = [("variant", (n, c)) for n in tc.GEMM_VARIANTS for c in (None, {"tl.disable_wgmma": True})]  # as the tests
    work += [("public", n) for n in tc.GPU]
    for path in ("mma", "wgmma"):
        work += [("probe", ("gemm", path, False, dt, sh, cfg)) for dt, sh, cfg in GEMM_CASES]
        work += [("probe", ("fa", path, c)) for c in (False, True)]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs) as ex:
        for line in ex.map(_warm_one, work):
            if "Error" in line:
                print(line, flush=True)
    print(f"warm: {len(work)} kernels in {time.perf_counter() - t0:.1f}s", flush=True)


def sass(names: list[str], out: str) -> None:
    """Opcode histogram of each kernel's SASS (cuobjdump on the cubin); the full listing goes to `out`."""
    import collections
    import re
    import subprocess
    import tempfile

    for name in names:
        kind, path = name.replace("gemm16", "gemm").split("_")
        k, _ = build(kind, path)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(k._impl.module.cubin)
        text = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        Path(out, f"{name}.sass").write_text(text)
        ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text))
        print(f"{name}: {sum(ops.values())} SASS instructions; top: " +
              ", ".join(f"{o} {n}" for o, n in ops.most_common(16)), flush=True)


def ncu_target(names: list[str]) -> None:
    """Run each kernel once, in order (profile with `ncu -k regex:tl_ -c <len(names)>`). NAME: kind_path with
    kind gemm16 / fa / facausal and path as for build(), or fa_sdpa / facausal_sdpa (torch's own backend choice, flash on
    the H200: `ncu -k regex:"tl_|flash|fmha|sdpa"`)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    qkv = tuple(torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    for name in names:
        kind, path = name.replace("gemm16", "gemm").split("_")
        causal = kind == "facausal"
        kind = "fa" if causal else kind
        if path == "sdpa":  # the peer as bench_cuda.py times it: torch's SDPA with its own backend choice
            torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=causal)
            torch.cuda.synchronize()
            print(f"{name}: ran SDPA", flush=True)
            continue
        # gemm16_two: cuda_ws_two_ctas needs a tile that fits twice per SM (bench_cuda's 128 x 128 x 64, 3 stages)
        k, _ = build(kind, path, causal, cfg=(128, 128, 64, 3, 256) if path == "two" else (128, 256, 64, 3, 256))
        k(*((a, b) if kind == "gemm" else qkv))
        torch.cuda.synchronize()
        print(f"{name}: ran kernel {k._impl.kernels[0][0]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["check", "ncu", "warm", "sass"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("kernels", nargs="*")
    ap.add_argument("--only", choices=["gemm", "fa"])
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.mode == "check":
        sys.exit(check(args.only, args.json))
    if args.mode == "warm":
        return warm(args.jobs)
    if args.mode == "sass":
        return sass(args.kernels, args.out)
    ncu_target(args.kernels)


if __name__ == "__main__":
    main()
