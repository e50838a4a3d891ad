#!/bin/bash
# kv15d round 2 (issue 15): same-run figures for the opt-in split merge over distributed shared memory
# (KVPOOL_DECODE_COMBINE=cluster) vs the combine launch (default) and the ticket merge, and for TILESTACK_PDL=1,
# under both L2 flushes of the bench (memset = "write", the issue's figures so far; "read" = cold and clean).
# One H100/H200, ~45 s expected, <= 75 s.
set -uo pipefail
source scripts/device_env.sh
source scripts/gpu/job.sh kv15d
touch /tmp/kv15d_marker
B=packages/dataengine/benchmarks
tests 35 gpu_tests.log -n 0 packages/kvpool/tests/test_cuda_decode_cluster.py packages/kvpool/tests/test_cuda_decode_pdl.py \
  packages/hal/tests/test_launch_pdl.py packages/hal/tests/test_bench.py packages/kvpool/tests/test_cuda_decode.py \
  -k "cluster or pdl or flush_modes or sparse_matches_reference or ticket_combine or mma_other_block_sizes"
TESTS_RC=$?
COMB=cluster,ticket
if [ $TESTS_RC -ne 0 ]; then COMB=ticket; el "cluster rows left out (tests rc=$TESTS_RC)"; fi
for FL in write read; do
  mkdir -p "$O/bench_$FL"
  STEP_LINES=0 BENCH_FLUSH=$FL BENCH_PATHS=default,default_pdl BENCH_DECODE_COMBINE=$COMB DATAENGINE_BENCH_OUT=$O/bench_$FL \
    step "$(left 72)" bench_step_quick_$FL.log python3 $B/bench_step_quick.py
  grep -E '^131072 ' "$O/bench_step_quick_$FL.log" | python3 -c '
import json, sys
last = {}
for line in sys.stdin:
    ctx, name, rest = line.split(" ", 2)
    last[name] = rest
print("'$FL' dense (eager, graph):", last.get("dense", "?").strip())
for name, rest in last.items():
    if name != "dense":
        r = json.loads(rest)
        print(name, json.dumps({k: v for k, v in r.items() if k.startswith(("sparse_decode_only", "step_default",
              "speedup_default", "select_default", "decode_", "default_equals", "default_pdl_equals"))}))'
done
find /tmp/kv15d_cache -name '*.pack' -newer /tmp/kv15d_marker > "$O/built_on_device.txt"
el "compiled on the device: $(wc -l < "$O/built_on_device.txt") kernels (built_on_device.txt)"
el end
