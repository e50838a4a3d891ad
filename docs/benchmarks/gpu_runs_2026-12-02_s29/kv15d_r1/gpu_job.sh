#!/bin/bash
# kv15d round 1 (issue 15: what the b8 x 128K sparse decode step's time is made of), one H100/H200, <= 75 s.
# 1. profile_step.py --times: every piece (score, top-k, select, sparse decode, step, dense) under four L2 states
#    (zero = tilehal.bench's memset flush, read, zero+read, none), split sweep, decode over 4 layouts of the same blocks, TILESTACK_PDL=1 rows, CUPTI trace
# 2. ncu (clean L2 per kernel): SpeedOfLight / LaunchStats / Occupancy / WarpStateStats + DRAM bytes of one step
#    (score, top-k, decode, combine) and the sparse decode at 1 and 2 splits
# 3. GPU tests: the PDL decode (7) + the adversarial selection, default and TILESTACK_PDL=1 (12)
# 4. ncu --cache-control none after the memset: each kernel's DRAM bytes written (the flush's dirty lines)
set -uo pipefail
source scripts/device_env.sh
source scripts/gpu/job.sh kv15d
touch /tmp/kv15d_marker
B=packages/dataengine/benchmarks
mkdir -p "$O/bench"
STEP_LINES=60 DATAENGINE_BENCH_OUT=$O/bench step 24 profile_times.log python3 $B/profile_step.py --times
NCU_SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
NCU_METRICS="--metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum"
STEP_LINES=0 step "$(left 50)" ncu_clean.log ncu --profile-from-start off --clock-control none $NCU_SECTIONS \
  $NCU_METRICS python3 $B/profile_step.py --ncu clean
grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|dram__bytes|Memory Throughput|Waves Per SM|Grid Size|Achieved Occupancy|Registers Per|No Eligible" \
  "$O/ncu_clean.log" | cut -c1-150 | head -80
tests "$(left 66)" gpu_tests.log -n 0 packages/hal/tests/test_launch_pdl.py packages/hal/tests/test_bench.py packages/kvpool/tests/test_cuda_decode_pdl.py \
  packages/dataengine/tests/test_cuda_select.py -k "pdl or flush_modes_on_a_gpu or (test_default_selection_adversarial and -default)"
STEP_LINES=0 step "$(left 75)" ncu_dirty.log ncu --profile-from-start off --clock-control none --cache-control none \
  $NCU_METRICS python3 $B/profile_step.py --ncu dirty
grep -E "^  [a-z_]+.*\(|dram__bytes|gpu__time" "$O/ncu_dirty.log" | cut -c1-150 | head -30
find /tmp/kv15d_cache -name '*.pack' -newer /tmp/kv15d_marker > "$O/built_on_device.txt"
el "compiled on the device: $(wc -l < "$O/built_on_device.txt") kernels (built_on_device.txt)"
el end
