#!/bin/bash
# fp4m (issue 19 item 3, FP4 weights), round 2, one H100/H200, <= 75 s.
# Round 1 (r1/): the decode-to-shared kernel (DEEPGEMM_FP4_KERNEL=dec) was correct but 0.5-0.8x cuBLAS bf16: ~0.45 us
# of fixed latency per 128-K chunk, independent of the activation bytes (multicast, e4m3: no gain) -- a chain of 4-8
# dependent small-N wgmmas per chunk. Now: independent accumulator sets (consecutive wgmmas of a chunk no longer wait
# for each other) and, as variants, K splits with two CTAs per SM (half the chunks per CTA). Timed at all 12 issue rows
# (M = 1, 16 too: a 64-token tile costs the same there) against the current defaults, cuBLAS bf16 and deepgemm fp8.
# Kernel cache warmed with NVRTC 13.0 (scripts/gpu/fp4m_warm.py via scripts/gpu/warm.sh: 183 FP4 kernels).
set -uo pipefail
source scripts/device_env.sh
source scripts/gpu/job.sh fp4m
D=packages/deepgemm
for mnk in "1 7168 2048" "16 7168 2048" "64 7168 2048" "128 7168 2048" "1 2112 7168" "16 2112 7168" \
           "64 2112 7168" "128 2112 7168" "1 4096 7168" "16 4096 7168" "64 4096 7168" "128 4096 7168"; do
  timeout 30 python3 dg_fp8_warm.py $mnk > /dev/null 2>> "$O/dg_fp8_warm.log" &
done
# 1. the dec kernel vs the float64 reference (GPU tests): planned configurations, then the A/B variants
tests "$(left 26)" tests.log -n 0 $D/tests/test_fp4_dec.py -k "not variants"
TA=$?
tests "$(left 36)" tests_variants.log -n 0 $D/tests/test_fp4_dec.py -k variants
TB=$?
wait; el "deepgemm fp8 warm done ($(grep -c Error "$O/dg_fp8_warm.log" 2>/dev/null) errors)"
# 2. bench at the 12 issue rows (L2 flushed and CUDA graph), same run: the defaults (bf16_fp4_auto, fp8_fp4_auto), the
#    dec kernel and its variants (s2: 2 K splits; b2s2 / b2s4: two CTAs per SM with 2 / 4 splits), cuBLAS bf16,
#    deepgemm fp8, the e4m3 cast alone
ONLY=bf16_fp4_auto,fp8_fp4_auto,cublas_bf16,deepgemm_fp8,cast_fp8
V=""
if [ "$TA" -eq 0 ]; then
  ONLY="$ONLY,bf16_fp4_dec,fp8_fp4_dec"
  if [ "$TB" -eq 0 ]; then
    for kind in bf16 fp8; do
      V="$V;${kind:0:1}s2:${kind}_fp4_dec:1,16,64,128:DEEPGEMM_FP4_DEC_SPLITS=2"
      V="$V;${kind:0:1}b2s2:${kind}_fp4_dec:1,16,64,128:DEEPGEMM_FP4_DEC_SPLITS=2,DEEPGEMM_FP4_DEC_BLOCKS=2"
      V="$V;${kind:0:1}b2s4:${kind}_fp4_dec:1,16,64,128:DEEPGEMM_FP4_DEC_SPLITS=4,DEEPGEMM_FP4_DEC_BLOCKS=2"
    done
  fi
fi
STEP_LINES=30 step "$(left 62)" bench.log python3 $D/benchmarks/bench_fp4.py --out "$O/bench" --only "$ONLY" --variants "$V"
# 3. ncu of the dec kernel at M = 128 (both activation kinds, 4096 x 7168 / 2112 x 7168) with the stall reasons
if [ "$TA" -eq 0 ] && command -v ncu > /dev/null; then
  S=smsp__average_warps_issue_stalled
  M="dram__bytes_read.sum,lts__t_bytes.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed"
  for r in long_scoreboard barrier wait membar short_scoreboard mio_throttle math_pipe_throttle dispatch_stall \
           no_instruction sleeping lg_throttle selected; do M="$M,${S}_${r}_per_issue_active.ratio"; done
  STEP_LINES=4 step "$(left 75)" ncu.log ncu --clock-control none --kernel-name regex:fp4_dec --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats --metrics "$M" \
    python3 $D/benchmarks/bench_fp4.py --ncu-launch --ncu-cases dec_128,dec_e4m3_128,dec_128_2112,dec_e4m3_128_2112
fi
el end
