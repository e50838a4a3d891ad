#!/bin/bash
# fp4 (issue 19, FP4 weights at small M), session 28, one H200. Kernel cache warmed on the CPU machine with NVRTC
# 13.0 (scripts/gpu/fp4_warm.py via scripts/gpu/warm.sh; 93 FP4 kernels); deepgemm fp8 (the peer) and the fp8
# casts compile on the device in parallel with the tests.
# 1. GPU tests of the small-M kernel (test_fp4.py -k small: vs the float64 reference, N % 64 != 0, K = 16384,
#    fp32 scales, C + graph replay, masked grouped, the A/B variants).
# 2. bench_fp4 at the 12 issue rows (L2 flushed and CUDA graph): small-M kernel vs the default policy vs the
#    mma.sync kernel vs cuBLAS bf16 vs deepgemm fp8, plus 4 variants of the small kernel at M = 1 / 16 (at M = 64 / 128
#    the small kernel runs its 8-token-tile build, as m-blocks at 128).
# 3. bench_fp4 at M = 32 (small vs auto vs cuBLAS). 4. ncu of the small kernel at M = 1 / 16 if time is left.
set -uo pipefail
source scripts/device_env.sh
source scripts/gpu/job.sh fp4
D=packages/deepgemm
for mnk in "1 7168 2048" "16 7168 2048" "64 7168 2048" "128 7168 2048" "1 2112 7168" "16 2112 7168" \
           "64 2112 7168" "128 2112 7168" "1 4096 7168" "16 4096 7168" "64 4096 7168" "128 4096 7168"; do
  timeout 30 python3 dg_fp8_warm.py $mnk > /dev/null 2>> "$O/dg_fp8_warm.log" &
done
tests 26 tests.log -n 0 $D/tests/test_fp4.py -k small
wait; el "deepgemm fp8 warm done ($(grep -c Error "$O/dg_fp8_warm.log" 2>/dev/null) errors)"
V="small_pf256:bf16_fp4_small:1,16:DEEPGEMM_FP4_SMALL_PF=256"
V="$V;small_p4b2:bf16_fp4_small:1,16:DEEPGEMM_FP4_SMALL_SLOTS=4,DEEPGEMM_FP4_SMALL_MINB=2"
V="$V;small_p1b4:bf16_fp4_small:1:DEEPGEMM_FP4_SMALL_SLOTS=1,DEEPGEMM_FP4_SMALL_MINB=4"
V="$V;small_rw1:bf16_fp4_small:1,16:DEEPGEMM_FP4_SMALL_RW=1"
STEP_LINES=60 step "$(left 50)" bench.log python3 $D/benchmarks/bench_fp4.py --out "$O/bench" \
  --only bf16_fp4_small,bf16_fp4_auto,bf16_fp4,cublas_bf16,deepgemm_fp8 --variants "$V"
step "$(left 55)" bench_m32.log python3 $D/benchmarks/bench_fp4.py --ms 32 --only bf16_fp4_small,bf16_fp4_auto,cublas_bf16
if command -v ncu > /dev/null && [ "$(left 58)" -gt 8 ]; then
  step "$(left 59)" ncu.log ncu --kernel-name regex:fp4_small --launch-count 2 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 $D/benchmarks/bench_fp4.py --ncu-launch --ncu-cases small_1,small_16
fi
el end
