#!/bin/bash
# grouped (issues 19 + 17) R3 (final figures) on the H200. Kernel cache warmed off the device (NVRTC 13.0,
# scripts/gpu/grouped_warm.py) from /tmp/grouped_tree with the carried key (.kkey: a key made for this cache only).
# 1. bench_grouped with the default kernels and the best variants. 2. bench_models' MoE row. 3. ncu of the
# contiguous fp8 kernel (default vs variant) for the profile of the miss. Files -> $JOB_OUT.
set -uo pipefail; source scripts/device_env.sh
O=$JOB_OUT; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
pwd; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.limit --format=csv,noheader
rm -rf /tmp/grouped_tree /tmp/grouped_key; mkdir -p /tmp/grouped_tree /tmp/grouped_key; chmod 700 /tmp/grouped_key
cp -a . /tmp/grouped_tree/; cp .kkey/cache.key /tmp/grouped_key/cache.key; chmod 600 /tmp/grouped_key/cache.key
cd /tmp/grouped_tree && source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
export TILESTACK_CACHE_DIR=/tmp/grouped_tree/.kcache TILESTACK_CACHE_KEY_FILE=/tmp/grouped_key/cache.key
VARIANTS=${VARIANTS:-serial,info,mcast}
timeout 18 python3 packages/deepgemm/benchmarks/bench_grouped.py --variants $VARIANTS --out $O/bench_grouped.json \
  > $O/bench_grouped.log 2>&1
el "grouped bench rc=$?"; grep -vE "Warning|warn" $O/bench_grouped.log | cut -c1-200 | tail -32
timeout 22 python3 benchmarks/bench_models.py --only moe --budget-s 20 --json $O/bench_moe.json > $O/bench_moe.log 2>&1
el "moe rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_moe.log | cut -c1-300 | head -50
LEFT=$(( 52 - $(date +%s) + T0 ))
if [ $LEFT -gt 6 ] && command -v ncu > /dev/null; then
  timeout $LEFT ncu --clock-control none -k regex:gemm_sm90 --launch-count 4 --section SpeedOfLight \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --csv \
    python3 packages/deepgemm/benchmarks/bench_grouped.py --once --variants $VARIANTS > $O/ncu_grouped.csv 2> $O/ncu.err
  el "ncu rc=$?"; wc -l $O/ncu_grouped.csv; tail -3 $O/ncu.err
fi
el end
