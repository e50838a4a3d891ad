#!/bin/bash
# grouped (issues 19 + 17) R2 on the H200. Kernel cache warmed off the device (NVRTC 13.0, scripts/gpu/grouped_warm.py)
# from /tmp/grouped_tree with the carried key (.kkey: a key made for this cache only), so the tree runs from there.
# 1. bench_grouped: contiguous serial vs the producer-fed tile schedule (DEEPGEMM_TILE_INFO=1, serial / overlapped
#    promotion), masked default vs tile schedule, SwiGLU A/B. 2. bench_models' MoE row (host plans for the grouped
#    GEMMs, M-major scale gather). 3. GPU tests: deepgemm fp8 grouped (smem of grouped configs changed) + MoE paths.
set -uo pipefail; source scripts/device_env.sh
O=$JOB_OUT; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
pwd; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/grouped_tree /tmp/grouped_key; mkdir -p /tmp/grouped_tree /tmp/grouped_key; chmod 700 /tmp/grouped_key
cp -a . /tmp/grouped_tree/; cp .kkey/cache.key /tmp/grouped_key/cache.key; chmod 600 /tmp/grouped_key/cache.key
cd /tmp/grouped_tree && source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
export TILESTACK_CACHE_DIR=/tmp/grouped_tree/.kcache TILESTACK_CACHE_KEY_FILE=/tmp/grouped_key/cache.key
el "tree at $(pwd), cache $(ls $TILESTACK_CACHE_DIR | head -3 | tr '\n' ' ')"
timeout 22 python3 packages/deepgemm/benchmarks/bench_grouped.py --out $O/bench_grouped.json > $O/bench_grouped.log 2>&1
el "grouped bench rc=$?"; grep -vE "Warning|warn" $O/bench_grouped.log | cut -c1-200 | tail -32
timeout 24 python3 benchmarks/bench_models.py --only moe --budget-s 22 --json $O/bench_moe.json > $O/bench_moe.log 2>&1
el "moe rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_moe.log | cut -c1-300 | head -50
LEFT=$(( 68 - $(date +%s) + T0 ))
if [ $LEFT -gt 5 ]; then
  timeout $LEFT python3 -m pytest -q -n 3 -p no:cacheprovider -m gpu -rfE packages/deepgemm/tests/test_swiglu_epilogue.py \
    tests/test_moe_layout_kernel.py tests/test_moe.py packages/deepgemm/tests/test_gpu.py packages/deepgemm/tests/test_grouped_variants.py \
    -k "swiglu or layout or moe or variants or ((grouped_contiguous or grouped_masked or multicast) and True)" > $O/gpu_tests.log 2>&1
  el "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed|Error" $O/gpu_tests.log | head -20
fi
el end
