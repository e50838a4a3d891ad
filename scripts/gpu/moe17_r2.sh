#!/bin/bash
# moe17 (issue 17) R2 on the H200 (final figures), R1's kernel cache unpacked first:
#   1. bench_models moe (GPU quiet: eager host lead-in counts)   2. kernels for prefill/decode/compile warmed in the
#   background while the GPU tests of FusedRMSNorm / the MoE path / the bf16 choice run   3. compile (plain vs bf16)
#   4. prefill + decode (plain vs bf16 / bf16 + fused MLP). Files -> $JOB_OUT.
set -uo pipefail; source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
O=$JOB_OUT; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ -f cache.tgz ]; then mkdir -p $TILESTACK_CACHE_DIR && tar xzf cache.tgz -C $TILESTACK_CACHE_DIR; el "cache unpacked"; fi
timeout 16 python3 benchmarks/bench_models.py --only moe --budget-s 15 --json $O/bench_moe.json > $O/bench_moe.log 2>&1
el "moe rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_moe.log | cut -c1-330 | head -40
( timeout 18 python3 benchmarks/bench_models.py --precompile --only compile,prefill,decode --variants bf16,bf16_mlp \
  --budget-s 1 > $O/warm.log 2>&1 ) &
WARM=$!
timeout 18 python3 -m pytest -q -n 3 -p no:cacheprovider -m gpu -rfE tests/test_norm.py tests/test_bf16_choice.py \
  tests/test_moe.py -k "not reference" > $O/gpu_tests.log 2>&1; el "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $O/gpu_tests.log | head -20
wait $WARM; el "warm rc=$? $(grep precompiled $O/warm.log)"
timeout 42 python3 benchmarks/bench_models.py --only compile --variants bf16 --budget-s 80 \
  --json $O/bench_compile.json > $O/bench_compile.log 2>&1
el "compile rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_compile.log | cut -c1-330 | head -20
LEFT=$(( 88 - $(date +%s) + T0 ))
[ $LEFT -gt 8 ] && timeout $LEFT python3 benchmarks/bench_models.py --only prefill,decode --variants bf16,bf16_mlp \
  --budget-s 80 --json $O/bench_prefill_decode.json > $O/bench_prefill_decode.log 2>&1
el "prefill/decode rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_prefill_decode.log | cut -c1-330 | head -30
el end
