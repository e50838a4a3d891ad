#!/bin/bash
# moe17 (issue 17) R2 on the H200 (final figures): the R1 kernel cache unpacked, decode + prefill kernels
# warmed in the background, then bench_models prefill and decode (plain vs bf16 / bf16 + fused MLP), then
# moe again if time is left. Files -> $JOB_OUT.
set -uo pipefail; source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
O=$JOB_OUT; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ -f cache.tgz ]; then mkdir -p $TILESTACK_CACHE_DIR && tar xzf cache.tgz -C $TILESTACK_CACHE_DIR; el "cache unpacked"; fi
V=${V:-bf16,bf16_mlp}
timeout 16 python3 benchmarks/bench_models.py --precompile --only prefill,decode --variants $V --budget-s 1 > $O/warm.log 2>&1
el "warm rc=$? $(grep precompiled $O/warm.log)"
LEFT=$(( 47 - $(date +%s) + T0 ))
timeout $LEFT python3 benchmarks/bench_models.py --only decode,prefill,moe --variants $V --budget-s $(( LEFT - 1 )) \
  --json $O/bench_models.json > $O/bench_models.log 2>&1
el "bench rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_models.log | cut -c1-330 | head -60
el end
