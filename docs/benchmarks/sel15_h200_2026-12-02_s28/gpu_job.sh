#!/bin/bash
# sel15 (issue 15: the selection figures), one H200, ~60 s (every step has a limit; all of it ends by ~85 s).
# Run from the root of the carried tree (sel15's worktree + /work/gpuq/sel15/*); scripts/gpu/job.sh copies it to
# /tmp/sel15_tree and installs the cache warmed on the CPU machine with NVRTC 13.0 (sel15_cache.tgz / .key).
# 1. the must-hold adversarial selection test on the defaults and on six opt-in combinations (42 cases, -n 0)
# 2. bench_step_quick: 128K (dense decode, the default vs every opt-in, step speedups, the launches apart), then
#    the curve 64K-8K for the default and the opt-in combinations most likely to win
# 3. the opt-ins' own exactness tests with the time left (to 70 s: the score kernels' exact bounds, int4 heads /
#    records grids, fp8 ring heads_occ3 / records / h1; to 82 s: topk_blocks fastx (then fast512 / 256), int4
#    select [on_pairs])
set -uo pipefail
source scripts/device_env.sh
source scripts/gpu/job.sh sel15
touch /tmp/sel15_marker
tests 40 select_adversarial.log -n 0 -v packages/dataengine/tests/test_cuda_select.py -k default_selection_adversarial
grep -E "PASSED|FAILED" "$O/select_adversarial.log" | sed 's/.*:://' | cut -c1-120 | head -40
P=default,two_ring_heads,two_ring_heads_occ3,two_ring_records,two_ring_heads_h1,two_ring_records_h1,two_ring_heads_tx
P=$P,two_ring_heads_t512,two_ring_heads_t256,two_ring_heads_h1_tx,two_ring_records_h1_tx
P=$P,two_ring_heads_occ3_tx,two_ring_records_tx,two_ring_heads_pairs,two_ring_heads_pairs_occ3,two_ring_records_pairs
P=$P,two_ring_heads_pairs_tx,two_ring_heads_pairs_t512,two_ring_heads_pairs_t256,two_ring_heads_pairs_occ3_tx
P=$P,two_ring_records_pairs_tx,two_ring_records_pairs_occ3,two_ring_records_pairs_occ3_tx,default_optin,default_optin_occ3
C=default,default_optin,default_optin_occ3,two_ring_heads_occ3_tx,two_ring_records_tx,two_ring_heads_pairs_occ3_tx
C=$C,two_ring_records_pairs_occ3_tx,two_ring_heads_h1_tx
mkdir -p "$O/bench"
STEP_LINES=0 BENCH_PATHS=$P BENCH_CONTEXTS=131072,65536,32768,16384,8192 BENCH_CURVE_SUMMARIES=fp8,int4 \
  BENCH_CURVE_PATHS=$C DATAENGINE_BENCH_OUT=$O/bench step 50 bench_step_quick.log \
  python3 packages/dataengine/benchmarks/bench_step_quick.py
grep -E '^[0-9]+ ' "$O/bench_step_quick.log" | python3 -c '
import json, sys
last = {}
for line in sys.stdin:  # a line per path as it completes: the last one of each (context, summaries) holds all
    ctx, name, rest = line.split(" ", 2)
    last[(ctx, name)] = rest
for (ctx, name), rest in last.items():
    if name == "dense":
        print(ctx, "dense", rest.strip()); continue
    r = json.loads(rest)
    sel = {k[7:-3]: v for k, v in r.items() if k.startswith("select_") and k.endswith("_us") and "graph" not in k}
    spd = {k[8:]: v for k, v in r.items() if k.startswith("speedup_") and "graph" not in k}
    eq = {k[:-17]: v for k, v in r.items() if k.endswith("_equals_reference")}
    apart = {k[:-3]: v for k, v in r.items() if (k.startswith("score_") or k.startswith("topk_")) and k.endswith("_us")}
    print(ctx, name, "select_us", sel, "speedup", spd, "apart", apart, "sparse_only", r.get("sparse_decode_only_us"),
          "all_exact", all(eq.values()), "inexact", [k for k, v in eq.items() if not v])' 2>&1 | cut -c1-1500
tests "$(left 70)" select_optin_scores.log -n 0 packages/dataengine/tests/test_cuda_select.py \
  -k "int4_heads_grid or (fp8_ring_scores_exact and (heads_occ3 or records or h1))"
tests "$(left 82)" select_optin_topk.log -n 0 packages/dataengine/tests/test_cuda_select.py \
  -k "(topk_blocks_exact and fastx) or (int4_select_equals_reference and on_pairs) or (topk_blocks_exact and (fast512 or fast256))"
find /tmp/sel15_cache -name '*.pack' -newer /tmp/sel15_marker > "$O/built_on_device.txt"
el "compiled on the device: $(wc -l < "$O/built_on_device.txt") kernels (built_on_device.txt)"
el end
