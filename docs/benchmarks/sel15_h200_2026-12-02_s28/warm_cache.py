"""Compile (NVRTC 13.0 = the device's, no GPU) every kernel sel15's gpu_job.sh needs into the tilehal cache.
Run through scripts/gpu/warm.sh sel15 TREE python3 warm_cache.py (from the carried tree's root).

Kernels: the selection paths of the job's GPU tests (test_default_selection_adversarial with the default and the
opt-in combinations; test_int4_heads_grid_scores_exact; test_int4_select_equals_reference[on_pairs];
test_fp8_ring_scores_exact[heads_occ3 / records / *_h1]; test_topk_blocks_exact[fastx / fast512 / fast256]: the top-k
module), bench_step_quick's (heads / records ring scores fp8 and int4 with pairs and OCC 3, the one-launch
kernels of the shorter contexts, the bf16 mma score kernel, the top-k module) and kvpool's default decode."""

import sys
import time

import tilehal
import torch
from dataengine import cuda_select as cs
from kvpool import cuda_decode, cuda_write

assert tilehal.compiler_versions()["nvrtc"] == "13.0", tilehal.compiler_versions()
FP8, U8 = torch.float8_e4m3fn, torch.uint8
t0 = time.time()
n = 0


def done(what, m):
    global n
    n += 1
    print(f"[{time.time() - t0:5.1f}s] {what}: {'hit' if m.cache_hit else 'built'}", flush=True)


heads, records, chunks = set(), set(), set()  # (s_dtype, D, G, reduce, H, pairs, occ) / (s, D, G, reduce, pairs)


def want_scores(s, D, G, red, H, grid, pairs=False, occ=2):
    """What quest_raw_scores compiles for the ring scores on this grid (its fall-backs applied)."""
    if s == U8:
        pairs = pairs and G <= cs.PAIRS_MAX_GROUP  # fp8: pairs = DATAENGINE_RING_FP8=h1
    if occ == 3 and ((grid == "records" and s != U8) or (s == U8) != pairs):
        occ = 2
    (records if grid == "records" else heads).add((s, D, G, red, H, pairs, occ))


# the adversarial test (GQA 32/8, d128, max): one launch (rows <= 2048 blocks) and two launches, every variant
for s, ring in ((torch.bfloat16, False), (FP8, True), (U8, True)):
    chunks.add((s, 128, 4, "max", False, ring))
chunks.add((U8, 128, 4, "max", True, True))
chunks.add((FP8, 128, 4, "max", True, True))  # fp8 h1 (pairsx, records_pairs_x)
for s in (FP8, U8):
    for grid, pairs, occ in (("heads", False, 2), ("heads", True, 2), ("heads", True, 3), ("records", False, 2),
                             ("records", True, 2), ("records", True, 3)):
        want_scores(s, 128, 4, "max", 8, grid, pairs, occ)
# test_int4_heads_grid_scores_exact
for G, H in ((4, 8), (8, 2), (8, 1)):
    for red in ("max", "mean"):
        for grid, pairs, occ in (("heads", False, 2), ("heads", True, 2), ("heads", True, 3), ("records", False, 2),
                                 ("records", True, 2), ("records", True, 3)):
            want_scores(U8, 128, G, red, H, grid, pairs, occ)
# test_int4_select_equals_reference[on_pairs] at d128
for G, H in ((4, 8), (8, 2)):
    for red in ("max", "sum", "mean"):
        chunks.add((U8, 128, G, red, G <= 4, True))
        want_scores(U8, 128, G, red, H, "heads", True, 2)
# test_fp8_ring_scores_exact[heads_occ3 / records / *_h1]
for D, G, H in ((128, 4, 8), (64, 1, 8), (128, 8, 2), (64, 6, 2)):
    for red in ("max", "sum", "mean"):
        for h1 in (False, True):
            chunks.add((FP8, D, G, red, h1, True))  # its select_blocks: one launch (rows of 700 blocks)
            want_scores(FP8, D, G, red, H, "heads", h1, 2)
            want_scores(FP8, D, G, red, H, "records", h1, 2)
        want_scores(FP8, D, G, red, H, "heads", False, 3)

for s, D, G, red, pairs, ring in sorted(chunks, key=str):
    done(f"chunk fused {s} G{G} {red} ring={ring} pairs={pairs}", cs.compile_chunk(s, D, G, red, True, ring, pairs=pairs))
for s, D, G, red, H, pairs, occ in sorted(heads, key=str):
    done(f"heads {s} d{D} G{G} H{H} {red} pairs={pairs} occ={occ}", cs.compile_heads(s, D, G, red, H, pairs=pairs, occ=occ))
for s, D, G, red, H, pairs, occ in sorted(records, key=str):
    done(f"records {s} d{D} G{G} H{H} {red} pairs={pairs} occ={occ}",
         cs.compile_records(s, D, G, red, H, pairs=pairs, occ=occ))
done("score mma bf16", cs.compile_score(torch.bfloat16, torch.bfloat16, 128, 4, "max", variant="mma"))
done("topk", cs.compile_topk())
done("write", cuda_write.compile_write())
done("decode", cuda_decode.compile_decode(torch.bfloat16, 128, 4, cfg=cuda_decode.DEFAULT_CONFIG))
print(f"{n} modules in {time.time() - t0:.0f} s")
sys.exit(0)
