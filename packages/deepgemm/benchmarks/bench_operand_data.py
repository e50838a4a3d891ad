"""bf16 dense GEMMs at M = 4096: deepgemm vs cuBLAS on N(0, 1) operands and on model-like ones, in one run.

    python packages/deepgemm/benchmarks/bench_operand_data.py [--json PATH] [--iters 20]

Inside a Llama-shaped model cuBLAS's lm_head GEMM ran 23 % faster than on N(0, 1) operands and deepgemm's 3 %
(docs/deepgemm.md, issue 19's bf16 row): a GEMM's speed depends on its operands' values. This times both kernels on
the six DeepSeek (N, K) shapes and the Llama-3 lm_head with (a) activations and weights N(0, 1) and (b) activations
N(0, 1), weights N(0, 0.02^2) (transformers' initializer range), tilehal.bench median with the L2 flushed, every
contender in the same run, and prints the ratios.
"""

from __future__ import annotations

import argparse
import json

SHAPES = [(4096, 2112, 7168), (4096, 24576, 1536), (4096, 32768, 512), (4096, 7168, 16384), (4096, 4096, 7168),
          (4096, 7168, 2048), (4096, 128256, 4096)]
DATA = {"normal": 1.0, "model": 0.02}   # the weights' standard deviation; activations N(0, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_operand_data: needs a CUDA GPU")
        return 1
    import deepgemm
    import tilehal

    rows = []
    g = torch.Generator("cuda").manual_seed(0)
    for m, n, k in SHAPES:
        a = torch.randn((m, k), device="cuda", generator=g).bfloat16()
        base = torch.randn((n, k), device="cuda", generator=g)
        d = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
        row = {"m": m, "n": n, "k": k}
        for label, std in DATA.items():
            w = (base * std).bfloat16()
            ours = tilehal.bench(lambda a=a, w=w, d=d: deepgemm.bf16_gemm_nt(a, w, d), iters=args.iters,
                                 flush_l2=True)
            peer = tilehal.bench(lambda a=a, w=w, d=d: torch.mm(a, w.t(), out=d), iters=args.iters, flush_l2=True)
            row[f"{label}_deepgemm_us"] = round(ours.median_s * 1e6, 1)
            row[f"{label}_cublas_us"] = round(peer.median_s * 1e6, 1)
            row[f"{label}_ratio"] = round(peer.median_s / ours.median_s, 3)
            del w
        rows.append(row)
        print(f"{m}x{n}x{k}: N(0,1) deepgemm {row['normal_deepgemm_us']:.1f} cuBLAS {row['normal_cublas_us']:.1f} us "
              f"({row['normal_ratio']:.3f}x) | model-like deepgemm {row['model_deepgemm_us']:.1f} cuBLAS "
              f"{row['model_cublas_us']:.1f} us ({row['model_ratio']:.3f}x)", flush=True)
    for label in DATA:
        prod = 1.0
        for r in rows:
            prod *= r[f"{label}_ratio"]
        print(f"geo-mean deepgemm vs cuBLAS, {label} operands: {prod ** (1 / len(rows)):.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": torch.cuda.get_device_name(), "timer": "tilehal.bench median, L2 flushed",
                       "weights_std": DATA, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
