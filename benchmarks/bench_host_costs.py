"""Host (CPU) time per call of the pieces of one eager kvpool decode layer, against torch ops of the same size.

    python benchmarks/bench_host_costs.py [--context 131072] [--batch 8] [--json PATH]

An eager decode step of a model on kvpool is host-bound once the attention is sparse (the GPU finishes a layer
before Python has launched the next): this times, without synchronizing, N calls of each piece and reports the
host microseconds per call — `pool.write` (K/V + key summaries), `dataengine.select_blocks`, `kvpool.paged_decode`
dense and sparse, one FusedRMSNorm, one fused RoPE — next to torch's `F.linear` at M = batch, an elementwise add,
and an empty tilehal launch (the floor of one launch through tilehal). The GPU queue is drained between pieces;
the first calls (compile, plans) are excluded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--summary-dtype", choices=("bf16", "fp8", "int4"), default="int4")
    p.add_argument("--device", default="cuda", help="cuda (the figures), or cpu (a smoke test of the script)")
    p.add_argument("--json")
    return p.parse_args(argv)


def host_us(fn, calls: int, sync) -> dict:
    """Median and min host microseconds per call over 5 batches of `calls` // 5 calls (no sync inside a batch)."""
    for _ in range(3):
        fn()
    sync()
    per = []
    n = max(1, calls // 5)
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t) / n * 1e6)
        sync()
    return {"us": round(statistics.median(per), 2), "min_us": round(min(per), 2)}


def main(argv=None) -> int:
    args = _args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_host_costs: no CUDA device (--device cpu runs a smoke test)")
        return 1
    import tilehal
    from dataengine import select_blocks
    from kvpool import KVPool, paged_decode

    from tilestack.norm import rms_norm
    from tilestack.rope import rope_in_place

    dev = torch.device(args.device)
    B, L, Hq, Hkv, D, bs = args.batch, args.context, 32, 8, 128, 16
    sdt = {"bf16": None, "fp8": torch.float8_e4m3fn, "int4": "int4"}[args.summary_dtype]
    pool = KVPool(1, Hkv, D, num_blocks=B * (L // bs + 2), block_size=bs, device=dev, summary_dtype=sdt)
    sids = list(range(B))
    last = []
    g = torch.Generator(device=dev).manual_seed(0)
    for s in sids:
        pool.add_sequence(s, [])
        sl = pool.append(s, L)
        kv = torch.randn(L, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
        pool.write(0, sl.to(dev), kv, kv)   # every position written: decode reads no stale K/V
        last.append(sl[-1:])
        del kv
    table, lens = pool.block_table(sids, device=dev), pool.seq_lens(sids, device=dev)
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16)
    k1 = torch.randn(B, Hkv, D, device=dev, dtype=torch.bfloat16)
    slots = pool.device_slots(torch.cat(last))   # each sequence's last position: a decode step's write
    kmin, kmax = pool.key_summary(0)
    idx = select_blocks(q, kmin, kmax, table, lens, 64, 1, 1, block_size=bs)
    x = torch.randn(B, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    nw = torch.ones(4096, device=dev, dtype=torch.bfloat16)
    qp, kp = torch.randn(B, 1, Hq * D, device=dev).bfloat16(), torch.randn(B, 1, Hkv * D, device=dev).bfloat16()
    cos, sin = torch.randn(B, 1, D, device=dev).bfloat16(), torch.randn(B, 1, D, device=dev).bfloat16()
    cuda = dev.type == "cuda"
    if cuda:
        empty = tilehal.compile_cuda("extern \"C\" __global__ void tilestack_empty(int) {}", arch="sm_90a",
                                     name="tilestack_empty").get_kernel("tilestack_empty")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pieces = {
        "torch_add": lambda: x.add(x),
        f"torch_linear_m{B}_4096x4096": lambda: torch.nn.functional.linear(x, w),
        "tilehal_empty_launch": (lambda: empty.launch(1, 32, (0,))) if cuda else None,
        "pool_write_1_token_each": lambda: pool.write(0, slots, k1, k1),
        "pool_key_summary": lambda: pool.key_summary(0),
        "select_blocks_top64": lambda: select_blocks(q, kmin, kmax, table, lens, 64, 1, 1, block_size=bs),
        "paged_decode_dense": lambda: paged_decode(q, pool, 0, table, lens),
        "paged_decode_sparse": lambda: paged_decode(q, pool, 0, table, lens, block_indices=idx),
        "fused_rms_norm": lambda: rms_norm(x, nw, 1e-5),
        "fused_rope": (lambda: rope_in_place(qp, kp, cos, sin, D)) if cuda else None,
    }
    res = {}
    for name, fn in pieces.items():
        if fn is None:
            continue
        try:
            res[name] = host_us(fn, args.calls, sync)
        except Exception as e:  # noqa: BLE001 - a piece that cannot run is a result
            res[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        r = res[name]
        print(f"{name:32s} " + (f"{r['us']:8.1f} us/call (min {r['min_us']:.1f})" if "us" in r else r["error"]),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": torch.cuda.get_device_name() if cuda else "cpu", "batch": B, "context": L,
                       "summary_dtype": args.summary_dtype, "host_us_per_call": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
