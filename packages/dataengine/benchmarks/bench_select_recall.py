# requires: kvpool (its summary encoders: the bytes a pool would keep)
"""How compact key summaries change what the selection picks: attention-mass recall of Quest
top-k over exact (bf16 pool), fp8 (e4m3, outward) and int4 (per-32-channel grid, outward)
summaries of the same keys, CPU, float32.

Keys (one kv head, d128, 16-token blocks, 8192 tokens = 512 blocks, 4 q heads per kv head):
  clustered  each block a centre (N(0, 2^2) per channel) + N(0, 0.3^2) noise: attention
             concentrates on the blocks whose centre aligns with q.
  outlier    the same with 4 channels x10 and 4 channels +5: outlier / biased channels as real
             K has them (the case that stresses a shared int4 grid).
  gaussian   i.i.d. N(0, 1) keys (flat attention: recall near budget / blocks whatever the
             summaries; the control).
Recall: the softmax mass (over all keys, per q head, averaged) of the chosen blocks; budget 32
blocks (6.25 %), sink 1, local 1; also the overlap of the chosen sets with the exact-summary
choice. Writes dataengine_select_recall.json (with --record).
"""

from __future__ import annotations

import json

import torch
from _common import write_json
from dataengine.select import select_blocks
from kvpool.storage import FP8_DTYPE, fp8_round_outward, int4_encode

N, D, BS, HQ, TOP, SEEDS = 8192, 128, 16, 4, 32, 8


def keys(kind: str, g: torch.Generator) -> torch.Tensor:
    nb = N // BS
    if kind == "gaussian":
        return torch.randn(N, 1, D, generator=g)
    k = (2.0 * torch.randn(nb, 1, D, generator=g)).repeat_interleave(BS, 0) + 0.3 * torch.randn(N, 1, D, generator=g)
    if kind == "outlier":
        k[:, :, :4] *= 10
        k[:, :, 4:8] += 5
    return k


def main() -> None:
    nb = N // BS
    table = torch.arange(nb, dtype=torch.int32)[None]
    lens = torch.tensor([N], dtype=torch.int32)
    rows = {}
    for kind in ("clustered", "outlier", "gaussian"):
        acc = {"exact": [], "fp8": [], "int4": []}
        overlap = {"fp8": [], "int4": []}
        for seed in range(SEEDS):
            g = torch.Generator().manual_seed(seed)
            q = torch.randn(1, HQ, D, generator=g).to(torch.bfloat16).float()
            k = keys(kind, g).to(torch.bfloat16).float()
            kb = k.reshape(nb, BS, 1, D)
            kmin, kmax = kb.amin(1), kb.amax(1)
            sums = {"exact": (kmin, kmax),
                    "fp8": (fp8_round_outward(kmin, up=False).view(FP8_DTYPE), fp8_round_outward(kmax, up=True).view(FP8_DTYPE)),
                    "int4": (int4_encode(kmin, up=False), int4_encode(kmax, up=True))}
            att = torch.softmax((q[0].double() @ k[:, 0].double().T) / D ** 0.5, -1)
            mass = att.reshape(HQ, nb, BS).sum(-1)
            chosen = {}
            for name, (lo, hi) in sums.items():
                sel = select_blocks(q, lo, hi, table, lens, TOP, 1, 1, block_size=BS)[0, 0]
                sel = sel[sel >= 0].long()
                chosen[name] = set(sel.tolist())
                acc[name].append(float(mass[:, sel].sum(-1).mean()))
            for name in overlap:
                overlap[name].append(len(chosen[name] & chosen["exact"]) / len(chosen["exact"]))
        rows[kind] = {f"recall_{n}": round(sum(v) / len(v), 4) for n, v in acc.items()}
        rows[kind].update({f"overlap_with_exact_{n}": round(sum(v) / len(v), 4) for n, v in overlap.items()})
        print(kind, json.dumps(rows[kind]), flush=True)
    write_json("select_recall", {
        "benchmark": "attention-mass recall of Quest top-k over exact / fp8 / int4 key summaries",
        "config": {"tokens": N, "head_dim": D, "block_size": BS, "q_heads_per_kv_head": HQ, "top_k": TOP,
                   "sink": 1, "local": 1, "seeds": SEEDS, "device": "cpu", "keys": "bf16-rounded"},
        "budget_fraction": TOP / nb, "results": rows})


if __name__ == "__main__":
    main()
