#!/bin/bash
# moe17 (issue 17) R3, only if device time is left: FusedRMSNorm's GPU tests while the prefill/decode bf16
# kernels warm in the background, then bench_models prefill + decode (plain vs bf16 / bf16 + FusedRMSNorm /
# + fused MLP). Files -> $JOB_OUT.
set -uo pipefail; source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
O=$JOB_OUT; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
( timeout 22 python3 benchmarks/bench_models.py --precompile --only prefill,decode --variants bf16,bf16_norm_mlp \
  --budget-s 1 > $O/warm.log 2>&1 ) &
WARM=$!
timeout 20 python3 -m pytest -q -n 2 -p no:cacheprovider -m gpu -rfE tests/test_norm.py > $O/gpu_tests_norm.log 2>&1
el "norm tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $O/gpu_tests_norm.log | head -12
wait $WARM; el "warm rc=$? $(grep precompiled $O/warm.log)"
LEFT=$(( 58 - $(date +%s) + T0 ))
timeout $LEFT python3 benchmarks/bench_models.py --only prefill,decode --variants bf16,bf16_norm,bf16_norm_mlp \
  --budget-s 80 --json $O/bench_prefill_decode.json > $O/bench_prefill_decode.log 2>&1
el "prefill/decode rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_prefill_decode.log | cut -c1-300 | head -30
el end
