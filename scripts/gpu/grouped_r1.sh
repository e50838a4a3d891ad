#!/bin/bash
# grouped (issues 19 + 17) R1 on the H200: the contiguous fp8 kernel's promotion variants (serial / overlapped with
# a 24- or 40-register producer) at the issue-19 and Mixtral MoE shapes, the masked shapes, then bench_models' MoE
# row (baseline of this session). Kernels compile in parallel first. Files -> $JOB_OUT.
set -uo pipefail; source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
O=$JOB_OUT; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
pwd; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
( timeout 22 python3 benchmarks/bench_models.py --precompile --only moe --budget-s 1 > $O/moe_warm.log 2>&1 ) &
WARM=$!
timeout 20 python3 packages/deepgemm/benchmarks/bench_grouped.py --compile --jobs 8 > $O/grouped_compile.log 2>&1
el "grouped compile rc=$? $(tail -1 $O/grouped_compile.log)"
timeout 16 python3 packages/deepgemm/benchmarks/bench_grouped.py --out $O/bench_grouped.json > $O/bench_grouped.log 2>&1
el "grouped bench rc=$?"; cat $O/bench_grouped.log | cut -c1-200 | tail -30
wait $WARM; el "moe warm rc=$? $(grep precompiled $O/moe_warm.log)"
LEFT=$(( 58 - $(date +%s) + T0 ))
timeout $LEFT python3 benchmarks/bench_models.py --only moe --budget-s $LEFT --json $O/bench_moe.json > $O/bench_moe.log 2>&1
el "moe rc=$?"; grep -vE "^\[transformers\]|Warning|warn" $O/bench_moe.log | cut -c1-300 | head -50
el end
