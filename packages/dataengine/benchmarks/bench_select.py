"""Cost of Quest block selection per decode step at 128K tokens, vs the dense attention it prunes.

Shapes: 32 q heads / 8 kv heads (GQA), head_dim 128, 16-token blocks (8192 blocks per
sequence), budget 2048 tokens (128 blocks). Timed on whatever device torch sees: selection
(select_blocks, which reads kmin/kmax = 2/16 of K), and in the same run dense decode attention
over the full contiguous KV (SDPA) as the peer cost. Paged block tables are shuffled.
"""

from __future__ import annotations

import torch
from _common import table, write_json
from dataengine.select import select_blocks
from tilehal import bench


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    Hq, Hkv, D, bs, ctx, budget = 32, 8, 128, 16, 128 * 1024, 128
    nb = ctx // bs
    rows = []
    for B in ((1, 8, 32) if dev == "cuda" else (1, 4)):
        g = torch.Generator(device=dev).manual_seed(0)
        pool_blocks = B * nb
        kmin = torch.randn(pool_blocks, Hkv, D, device=dev, dtype=dtype, generator=g) - 1
        kmax = kmin + 2
        table_ = torch.randperm(pool_blocks, device=dev, generator=g).reshape(B, nb).to(torch.int32)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(B, Hq, D, device=dev, dtype=dtype, generator=g)
        sel = bench(lambda a=(q, kmin, kmax, table_, lens): select_blocks(*a, budget), warmup=3, iters=20)
        row = {"device": dev, "batch": B, "context": ctx, "blocks": nb, "budget_blocks": budget,
               "select_us": round(sel.median_us, 1)}
        if dev == "cuda" or B == 1:
            k = torch.randn(B, Hkv, ctx, D, device=dev, dtype=dtype, generator=g)
            v = torch.randn_like(k)
            qd = q.unsqueeze(2)

            def dense(qd=qd, k=k, v=v):
                return torch.nn.functional.scaled_dot_product_attention(qd, k, v, enable_gqa=True)

            d = bench(dense, warmup=3, iters=20)
            row["dense_decode_us"] = round(d.median_us, 1)
            row["select_over_dense"] = round(sel.median_us / d.median_us, 3)
            del k, v
        rows.append(row)
    table(rows, list(rows[0]))
    write_json(f"select_{dev}", {"shapes": f"q_heads={Hq} kv_heads={Hkv} head_dim={D} block={bs} ctx={ctx}",
                                 "dtype": str(dtype), "results": rows})


if __name__ == "__main__":
    main()
