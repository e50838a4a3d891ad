"""Host cost and eager end-to-end time of the stack's small calls against the torch call of the same size.

Sections (each row: ours and the peer in the same run):
  gemm    deepgemm.bf16_gemm_nt / fp8_gemm_nt 128 x 7168 x 2048 (the issue's small GEMM) through the host
          fast path (a replayed plan), through the full checked path (every check, the heuristic, the
          descriptors: what each call cost before plans), GemmLinear bf16 / fp8 vs cuBLAS
          (F.linear, torch.mm(out=), nn.Linear)
  cast    the fused per-token / per-block fp8 cast kernels vs deepgemm's torch-op chains (GPU time)
  kvpool  paged_decode, batch 8 x 1024 cached tokens (GQA 32/8, d128, bf16) vs SDPA on contiguous K/V
  deepep  low_latency_dispatch + low_latency_combine on a one-rank (local) Buffer, 128 tokens x 7168,
          top-8 of 32 experts vs the same gather / weighted scatter with torch ops

host_us: median per-call host time over batches of back-to-back calls (perf_counter; what the
caller's thread spends). e2e_us: wall time per call of 200 back-to-back calls including the final
synchronize (eager end to end: the larger of host and GPU time). gpu_us: tilehal.bench (CUDA events,
host hidden).

Usage (GPU): python benchmarks/bench_host.py [--only gemm,cast,kvpool,deepep] [--json FILE]
"""

# requires: cuda

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
for _p in ("src", *(f"packages/{n}/src" for n in ("hal", "deepgemm", "deepep", "kvpool", "dataengine"))):
    if str(_ROOT / _p) not in sys.path:
        sys.path.insert(0, str(_ROOT / _p))

import tilehal  # noqa: E402

ROWS: list[dict] = []


def host_us(fn, batches: int = 20, per: int = 50) -> float:
    return tilehal.bench_host(fn, warmup=10, batches=batches, per=per).median_us


def e2e_us(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    xs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        xs.append((time.perf_counter() - t0) / n)
    return statistics.median(xs) * 1e6


def gpu_us(fn) -> float:
    return tilehal.bench(fn, warmup=5, iters=50).median_s * 1e6


def row(section: str, name: str, fn, peer: str | None = None, gpu: bool = False, note: str = "") -> dict:
    r = dict(section=section, name=name, host_us=host_us(fn), e2e_us=e2e_us(fn), note=note)
    if gpu:
        r["gpu_us"] = gpu_us(fn)
    if peer is not None:
        p = next(x for x in ROWS if x["section"] == section and x["name"] == peer)
        r["peer"] = peer
        r["host_vs_peer"] = r["host_us"] / p["host_us"]
        r["e2e_vs_peer"] = r["e2e_us"] / p["e2e_us"]
    ROWS.append(r)
    extra = f"  host {r['host_vs_peer']:.2f}x / e2e {r['e2e_vs_peer']:.2f}x of {peer}" if peer else ""
    g = f"  gpu {r['gpu_us']:8.2f} us" if gpu else ""
    print(f"{section:7s} {name:42s} host {r['host_us']:8.2f} us  e2e {r['e2e_us']:8.2f} us{g}{extra}  {note}",
          flush=True)
    return r


def sec_gemm() -> None:
    import importlib

    import deepgemm

    dg = importlib.import_module("deepgemm.gemm")  # the module (deepgemm.gemm is also a function's name)

    from tilestack.layers import GemmLinear

    m, n, k = 128, 7168, 2048
    a = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    a8 = deepgemm.per_token_cast_to_fp8(a, tma_aligned_sf=True)
    w8 = deepgemm.per_block_cast_to_fp8(w)
    with torch.no_grad():
        lin.weight.copy_(w)
        gl, gl8 = GemmLinear.from_linear(lin), GemmLinear.from_linear(lin, fp8=True)
        sh = f"{m}x{n}x{k}"
        row("gemm", "cuBLAS F.linear", lambda: torch.nn.functional.linear(a, w), gpu=True, note=sh)
        row("gemm", "cuBLAS torch.mm(out=)", lambda: torch.mm(a, w.t(), out=d), peer="cuBLAS F.linear", note=sh)
        row("gemm", "nn.Linear", lambda: lin(a), peer="cuBLAS F.linear", note=sh)
        row("gemm", "deepgemm.bf16_gemm_nt", lambda: deepgemm.bf16_gemm_nt(a, w, d), peer="cuBLAS F.linear",
            gpu=True, note="host fast path (replayed plan)")
        row("gemm", "deepgemm.bf16_gemm_nt full path", lambda: dg._bf16_gemm_checked(a, w, d, None, "nt", "nk"),
            peer="cuBLAS F.linear", note="every check + heuristic + descriptors (before plans)")
        row("gemm", "deepgemm.fp8_gemm_nt", lambda: deepgemm.fp8_gemm_nt(a8, w8, d), peer="cuBLAS F.linear",
            gpu=True, note="pre-cast operands, replayed plan")
        row("gemm", "GemmLinear bf16", lambda: gl(a), peer="nn.Linear", note="module call")
        row("gemm", "GemmLinear fp8", lambda: gl8(a), peer="nn.Linear", gpu=True, note="fused act cast + fp8 GEMM")


def sec_cast() -> None:
    import deepgemm
    from deepgemm import cuda_cast

    # (cuda_cast hook of the fused kernel, public cast, shapes); the torch-op rows run while the hook
    # answers None (what deepgemm does without the fused kernel)
    casts = (("per_token", deepgemm.per_token_cast_to_fp8, ((128, 7168), (4096, 4096), (4096, 14336))),
             ("per_block", deepgemm.per_block_cast_to_fp8, ((7168, 2048), (14336, 4096))))
    for name, cast, shapes in casts:
        fused = getattr(cuda_cast, name)
        for shape in shapes:
            x = torch.randn(shape, device="cuda").bfloat16()
            row("cast", f"{name} fused {shape}", lambda x=x, cast=cast: cast(x), gpu=True)
            try:
                setattr(cuda_cast, name, lambda *a, **kw: None)
                row("cast", f"{name} torch ops {shape}", lambda x=x, cast=cast: cast(x), gpu=True)
            finally:
                setattr(cuda_cast, name, fused)


def sec_kvpool() -> None:
    import kvpool

    hq, h, dh, bs, b, s = 32, 8, 128, 16, 8, 1024
    pool = kvpool.KVPool(1, h, dh, b * s // bs + 8, block_size=bs, dtype=torch.bfloat16, device="cuda",
                         prefix_caching=False, watermark=0.0)
    for i in range(b):
        pool.add_sequence(i, [0])
        pool.append(i, s)
    pool.k_cache.normal_()
    pool.v_cache.normal_()
    seqs = list(range(b))
    table, lens = pool.block_table(seqs), pool.seq_lens(seqs)
    q = torch.randn(b, hq, dh, device="cuda").bfloat16()
    ks, vs = zip(*(pool.gather(0, i) for i in seqs))
    kc = torch.stack([k.transpose(0, 1) for k in ks]).contiguous()
    vc = torch.stack([v.transpose(0, 1) for v in vs]).contiguous()
    q4 = q.unsqueeze(2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row("kvpool", "SDPA contiguous K/V", lambda: sdpa(q4, kc, vc, enable_gqa=True), gpu=True, note=f"b{b} x {s}")
    row("kvpool", "kvpool.paged_decode", lambda: kvpool.paged_decode(q, pool, 0, table, lens),
        peer="SDPA contiguous K/V", gpu=True, note=f"b{b} x {s}, block_size {bs}")


def sec_deepep() -> None:
    import deepep

    t, hidden, e, topk = 128, 7168, 32, 8
    buf = deepep.Buffer(transport="local", low_latency_mode=True, num_qps_per_rank=1, num_max_tokens_per_rank=t,
                        hidden=hidden)
    x = torch.randn(t, hidden, device="cuda").bfloat16()
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.rand(t, e, device="cuda", generator=g).topk(topk, dim=1).indices.to(torch.int64)
    w = torch.rand(t, topk, device="cuda", generator=g)

    def ll():
        recv, counts, handle, _, _ = buf.low_latency_dispatch(x, idx, t, e, use_fp8=False)
        out, _, _ = buf.low_latency_combine(recv, idx, w, handle)
        return out

    flat = idx.view(-1)

    def torch_peer():
        rows = x.index_select(0, torch.arange(t, device="cuda").repeat_interleave(topk))
        order = torch.argsort(flat, stable=True)
        grouped = rows[order]
        back = torch.empty_like(grouped)
        back[order] = grouped
        return (back.view(t, topk, hidden).float() * w.unsqueeze(-1)).sum(1).bfloat16()

    row("deepep", "torch gather + weighted sum", torch_peer, gpu=True, note=f"{t} tok x {hidden}, top-{topk}/{e}")
    row("deepep", "low_latency dispatch+combine", ll, peer="torch gather + weighted sum", gpu=True,
        note="one-rank local Buffer")


SECTIONS = {"gemm": sec_gemm, "cast": sec_cast, "kvpool": sec_kvpool, "deepep": sec_deepep}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    for name in (args.only.split(",") if args.only else SECTIONS):
        t0 = time.perf_counter()
        try:
            SECTIONS[name]()
        except Exception as e:
            traceback.print_exc()
            ROWS.append(dict(section=name, name="-", note=f"section failed: {type(e).__name__}: {str(e)[:300]}"))
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    if args.json:
        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    machine=torch.cuda.get_device_name(), torch=torch.__version__)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=ROWS), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
