# requires: cuda
"""SparseLinear 2:4 (torch semi-structured: cuSPARSELt / CUTLASS) vs dense nn.Linear at LLM shapes.

Needs a CUDA GPU with sparse tensor cores. For each (M tokens, N out, K in) the dense peer is
F.linear on the unpruned weight, timed in the same run with CUDA events (tilehal.bench, L2
flushed). TFLOP/s counts the dense-equivalent 2*M*N*K. Correctness: calc_diff of the sparse
output against the masked-dense reference.
"""

from __future__ import annotations

import torch
from _common import out_dir, save_figure, table, write_json
from dataengine.sparsity import SparseLinear
from tilehal import bench, calc_diff

SHAPES = [  # (M, N, K): square 8192, Llama-3-70B MLP up/gate and down, Llama-3-8B attention/MLP
    (4096, 8192, 8192), (4096, 28672, 8192), (4096, 8192, 28672), (4096, 14336, 4096), (128, 8192, 8192),
    (16384, 8192, 8192),
]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_sparse_linear needs a CUDA GPU")
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for M, N, K in SHAPES:
            torch.manual_seed(0)
            lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=dtype)
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            sl = SparseLinear.from_dense(lin, "2:4")
            ref = SparseLinear.from_dense(lin, "2:4", backend="dense")
            diff = calc_diff(sl(x), ref(x))
            d = bench(lambda lin=lin, x=x: lin(x), warmup=5, iters=30, flush_l2=True)
            s = bench(lambda sl=sl, x=x: sl(x), warmup=5, iters=30, flush_l2=True)
            flops = 2 * M * N * K
            rows.append({"dtype": str(dtype).removeprefix("torch."), "M": M, "N": N, "K": K, "path": sl.path,
                         "dense_us": round(d.median_us, 1), "sparse_us": round(s.median_us, 1),
                         "dense_tflops": round(flops / d.median_s / 1e12, 1),
                         "sparse_tflops_dense_equiv": round(flops / s.median_s / 1e12, 1),
                         "speedup": round(d.median_s / s.median_s, 3), "calc_diff_vs_masked_dense": f"{diff:.2e}"})
            print(rows[-1], flush=True)
            del lin, sl, ref, x
    table(rows, list(rows[0]))
    write_json("sparse_linear", {"note": "dense peer = F.linear (cuBLAS) on the unpruned weight, same run",
                                 "results": rows})
    if out_dir() is None:
        return
    import matplotlib  # the `bench` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['dtype']}\n{r['M']}x{r['N']}x{r['K']}" for r in rows]
    ax.bar(range(len(rows)), [r["speedup"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=60)
    ax.set_ylabel("2:4 sparse speedup over dense")
    ax.set_title(f"SparseLinear 2:4 vs dense, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    save_figure(fig, "dataengine_sparse_linear.png")


if __name__ == "__main__":
    main()
