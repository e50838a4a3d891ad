"""CPU benchmark: tilelang `cpu` target vs numpy (OpenBLAS) GEMM and torch SDPA flash-attention; compile times.

Run (numpy comparison with the machine's own OpenBLAS kernel choice, see docs/tilelang.md):
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python packages/tilelang/benchmarks/bench_cpu.py
With --record, writes docs/benchmarks/tilelang_cpu.json and tilelang_cpu.png. Ours and the peer are timed
alternately in the same run (the machine may be shared), median of the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tilehal
import tilelang
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"ex_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def alternate(fns: dict, rounds: int, reps: int = 3) -> dict[str, float]:
    """Best time per call of each function over `rounds` rounds of `reps` calls, the functions taking turns.

    Turns are blocks with a short pause between them: OpenBLAS, torch and our OpenMP runtime each keep
    worker threads spinning for a while after a call, which would otherwise steal the cores from the
    next contender. Best-of filters out other jobs on a shared machine.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            time.sleep(0.3)
            f()
            for _ in range(reps):
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def bench_gemm(n: int, configs: list[tuple[int, int, int]], rounds: int) -> dict:
    gemm = load_example("gemm")
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    results = []
    best = None
    for cfg in tqdm(configs, desc=f"gemm {n}^3 configs", leave=False):
        k = gemm.matmul(n, n, n, *cfg)
        t = alternate({"ours": lambda k=k: k(a, b), "numpy": lambda: a @ b}, rounds)
        gf = 2 * n**3 / t["ours"] / 1e9
        np_gf = 2 * n**3 / t["numpy"] / 1e9
        rec = {"block": cfg, "ours_s": t["ours"], "numpy_s": t["numpy"], "ours_gflops": gf, "numpy_gflops": np_gf,
               "ratio": t["numpy"] / t["ours"]}
        results.append(rec)
        if best is None or rec["ours_gflops"] > best["ours_gflops"]:
            best = rec
    c = gemm.matmul(n, n, n, *best["block"])(a, b)
    diff = tilehal.calc_diff(c, a.astype(np.float64) @ b)
    numpy_best = max(r["numpy_gflops"] for r in results)
    # conservative headline: our fastest config against numpy's fastest run of the whole benchmark
    return {"shape": [n, n, n], "dtype": "float32", "configs": results, "best": best, "calc_diff": diff,
            "numpy_best_gflops": numpy_best, "headline_ratio": best["ours_gflops"] / numpy_best}


def bench_flash(batch: int, heads: int, seq: int, dim: int, causal: bool, rounds: int) -> dict:
    import torch
    import torch.nn.functional as F

    fa = load_example("flash_attention")
    k = fa.flashattn(batch, heads, seq, dim, causal, 64, 64, 1, 128, "float32")
    q, kk, v = (torch.randn(batch, seq, heads, dim) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, kk, v))  # SDPA wants BHSD: not timed

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    t = alternate({"ours": lambda: k(q, kk, v), "torch_sdpa": sdpa}, rounds)
    out = k(q, kk, v)
    ref = sdpa().transpose(1, 2)
    flops = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    return {"shape": {"batch": batch, "heads": heads, "seq_len": seq, "dim": dim}, "causal": causal,
            "dtype": "float32", "ours_s": t["ours"], "torch_sdpa_s": t["torch_sdpa"],
            "ours_gflops": flops / t["ours"] / 1e9, "torch_sdpa_gflops": flops / t["torch_sdpa"] / 1e9,
            "ratio": t["torch_sdpa"] / t["ours"], "max_abs_err": float((out - ref).abs().max())}


_ONE_CORE_SNIPPET = """
import sys, json, time, importlib.util
import numpy as np
spec = importlib.util.spec_from_file_location("gemm", sys.argv[1]); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
n = int(sys.argv[2]); cfg = tuple(json.loads(sys.argv[3]))
a, b = np.random.rand(n, n).astype(np.float32), np.random.rand(n, n).astype(np.float32)
k = m.matmul(n, n, n, *cfg)
def best(f):
    f(); ts = []
    for _ in range(5):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return min(ts)
to, tn = best(lambda: k(a, b)), best(lambda: a @ b)
to, tn = min(to, best(lambda: k(a, b))), min(tn, best(lambda: a @ b))
print(json.dumps({"ours_gflops": 2 * n**3 / to / 1e9, "numpy_gflops": 2 * n**3 / tn / 1e9, "ratio": tn / to}))
"""


def bench_gemm_one_core(n: int, cfg: tuple) -> dict:
    """The same GEMM on one core each (OMP_NUM_THREADS=1, OPENBLAS_NUM_THREADS=1): per-core efficiency,
    much less sensitive than the 2-core run to other jobs on a shared machine."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _ONE_CORE_SNIPPET, str(EXAMPLES / "gemm.py"), str(n), json.dumps(cfg)],
                       env=env, capture_output=True, text=True, check=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["block"] = list(cfg)
    return out


_COMPILE_SNIPPET = """
import sys, time, importlib.util, json
t0 = time.perf_counter()
import tilelang
t_import = time.perf_counter() - t0
spec = importlib.util.spec_from_file_location("gemm", sys.argv[1]); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
t0 = time.perf_counter()
k = m.matmul(2048, 2048, 2048, 128, 128, 32)
total = time.perf_counter() - t0
print(json.dumps({"compile_s": total, "c_build_s": k.compile_seconds, "cache_hit": k.cache_hit,
                  "import_s": t_import}))
"""


def bench_compile() -> dict:
    """Cold (empty cache) and cached compile of the 2048^3 GEMM, each in a fresh process."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TILESTACK_CACHE_DIR=cache)
        for label in ("cold", "cached"):
            r = subprocess.run([sys.executable, "-c", _COMPILE_SNIPPET, str(EXAMPLES / "gemm.py")], env=env,
                               capture_output=True, text=True, check=True)
            out[label] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    g = res["gemm"]["best"]
    axes[0].bar(["tilelang cpu", "numpy (OpenBLAS)"], [g["ours_gflops"], res["gemm"]["numpy_best_gflops"]],
                color=["C0", "C1"])
    axes[0].set_title(f"fp32 GEMM 2048^3 (GFLOP/s, best of runs), ratio {res['gemm']['headline_ratio']:.2f}")
    labels, ours, peer = [], [], []
    for f in res["flash_attention"]:
        labels.append("causal" if f["causal"] else "non-causal")
        ours.append(f["ours_gflops"])
        peer.append(f["torch_sdpa_gflops"])
    x = np.arange(len(labels))
    axes[1].bar(x - 0.2, ours, 0.4, label="tilelang cpu")
    axes[1].bar(x + 0.2, peer, 0.4, label="torch SDPA")
    axes[1].set_xticks(x, labels)
    axes[1].legend()
    axes[1].set_title("flash-attn fwd fp32 (GFLOP/s)")
    c = res["compile"]
    axes[2].bar(["cold", "cached"], [c["cold"]["compile_s"], c["cached"]["compile_s"]], color=["C3", "C2"])
    axes[2].axhline(1.5, ls="--", color="gray")
    axes[2].set_title("GEMM compile time (s); target cold <= 1.5 s")
    fig.suptitle(f"tilelang CPU benchmark, {res['date']}, {res['machine']['cpu_name']}, load {res['load_average_start'][0]:.1f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--record", action="store_true", help="write the results into docs/benchmarks/ (default: print only)")
    ap.add_argument("--out", type=Path, default=None, help="write the results into this folder instead")
    args = ap.parse_args()
    import torch

    n = 256 if args.quick else args.n
    seq = 256 if args.quick else 1024
    configs = [(128, 128, 32), (128, 128, 64), (256, 128, 32), (128, 256, 32), (256, 256, 32)]
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": str(tilehal.cpu()), "cpu_name": tilehal.cpu().name, "platform": platform.platform(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "c_compiler": tilehal.c_compiler_version(
                        tilehal.c_compiler() or "cc"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "openblas_env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                         "OPENBLAS_NUM_THREADS")},
        "numpy_blas": _blas_info(),
        "tilelang": tilelang.__version__,
        # other jobs on a shared machine skew absolute numbers; ours and the peer alternate so ratios hold better
        "load_average_start": os.getloadavg(),
    }
    steps = ["gemm", "gemm one core", "flash non-causal", "flash causal", "compile"]
    with tqdm(total=len(steps), desc="bench_cpu") as bar:
        res["gemm"] = bench_gemm(n, configs, args.rounds)
        bar.update()
        res["gemm_one_core"] = bench_gemm_one_core(n, tuple(res["gemm"]["best"]["block"]))
        bar.update()
        res["flash_attention"] = [bench_flash(1, 8, seq, 64, False, args.rounds)]
        bar.update()
        res["flash_attention"].append(bench_flash(1, 8, seq, 64, True, args.rounds))
        bar.update()
        res["compile"] = bench_compile()
        bar.update()
    res["load_average_end"] = os.getloadavg()
    g = res["gemm"]
    print(f"\n{'benchmark':<34}{'ours':>14}{'peer':>14}{'ratio':>8}")
    for c in g["configs"]:
        print(f"{'gemm ' + str(n) + '^3 ' + str(tuple(c['block'])):<34}{c['ours_gflops']:>10.1f} GF/s"
              f"{c['numpy_gflops']:>10.1f} GF/s{c['ratio']:>8.2f}")
    print(f"{'gemm headline: best ours / best numpy':<34}{g['best']['ours_gflops']:>10.1f} GF/s"
          f"{g['numpy_best_gflops']:>10.1f} GF/s{g['headline_ratio']:>8.2f}")
    o = res["gemm_one_core"]
    print(f"{'gemm ' + str(n) + '^3 one core ' + str(tuple(o['block'])):<34}{o['ours_gflops']:>10.1f} GF/s"
          f"{o['numpy_gflops']:>10.1f} GF/s{o['ratio']:>8.2f}")
    for f in res["flash_attention"]:
        name = f"flash fwd {'causal' if f['causal'] else 'full'} S={seq}"
        print(f"{name:<34}{f['ours_s'] * 1e3:>11.2f} ms{f['torch_sdpa_s'] * 1e3:>11.2f} ms{f['ratio']:>8.2f}")
    c = res["compile"]
    print(f"{'compile gemm cold / cached':<34}{c['cold']['compile_s']:>12.3f} s{c['cached']['compile_s']:>12.3f} s")
    if args.record and args.out is None:
        args.out = ROOT / "docs" / "benchmarks"
    if args.out is None:
        print("not recorded (pass --record to write docs/benchmarks/tilelang_cpu.json)")
    elif not args.quick:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tilelang_cpu.json").write_text(json.dumps(res, indent=1, default=str))
        plot(res, args.out / "tilelang_cpu.png")
        print(f"wrote {args.out / 'tilelang_cpu.json'} and .png")


def _blas_info() -> str:
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg.get("Build Dependencies", {}).get("blas", {})
        return f"{blas.get('name')} {blas.get('version')} {blas.get('openblas configuration', '')}".strip()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({e})"


if __name__ == "__main__":
    main()
