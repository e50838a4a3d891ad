#!/bin/bash
# moe17 (issue 17) R1 on the H200: warm kernels (background) while the GPU tests of the new paths run, then
# bench_models moe (transformers block vs ExpertParallelMoE's one-process path, bf16/fp8, kernels, CUDA
# graph) and compile (plain vs bf16 under inductor). Files -> $JOB_OUT (+ the device's kernel cache for R2).
set -uo pipefail; source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
O=$JOB_OUT; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ -f cache.tgz ]; then mkdir -p $TILESTACK_CACHE_DIR && tar xzf cache.tgz -C $TILESTACK_CACHE_DIR; el "cache unpacked"; fi
( timeout 24 python3 benchmarks/bench_models.py --precompile --only moe,compile --variants bf16 --budget-s 1 \
  > $O/warm.log 2>&1 ) &
WARM=$!
timeout 20 python3 -m pytest -q -n 4 -p no:cacheprovider -m gpu -rfE tests/test_moe.py tests/test_norm.py \
  tests/test_bf16_choice.py > $O/gpu_tests.log 2>&1; el "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $O/gpu_tests.log | head -20
wait $WARM; el "warm rc=$? $(grep precompiled $O/warm.log)"
timeout 20 python3 benchmarks/bench_models.py --only moe --budget-s 19 --json $O/bench_moe.json > $O/bench_moe.log 2>&1
el "moe rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_moe.log | cut -c1-330 | head -60
LEFT=$(( 67 - $(date +%s) + T0 ))
if [ $LEFT -gt 15 ]; then
  timeout $LEFT python3 benchmarks/bench_models.py --only compile --variants bf16 --budget-s $(( LEFT + 20 )) \
    --json $O/bench_compile.json > $O/bench_compile.log 2>&1
  el "compile rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_compile.log | cut -c1-330 | head -20
fi
tar czf $O/cache.tgz -C $TILESTACK_CACHE_DIR . 2>/dev/null; ls -la $O/cache.tgz
[ "$(stat -c %s $O/cache.tgz 2>/dev/null || echo 0)" -gt 7000000 ] && rm -f $O/cache.tgz && echo "cache too big, dropped"
el end
