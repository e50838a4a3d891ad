#!/bin/bash
# fp4m (issue 19 item 3, FP4 weights at M = 64 / 128), round 1, one H100/H200, <= 75 s.
# Why deepgemm's fp8 kernel streams weights 2-3x better than the FP4 wgmma kernel at M = 128, and the first GPU run of
# the decode-to-shared FP4 kernel (DEEPGEMM_FP4_KERNEL=dec: DeepGEMM's fp8 tile shape, FP4 weights decoded into a
# shared B tile by the math warpgroups, SS wgmma, bf16 or e4m3 activations; variants: wider slices + K splits, TMA
# multicast of the activations over 2- / 4-CTA clusters). Kernel cache warmed with NVRTC 13.0 (scripts/gpu/fp4m_warm.py via
# scripts/gpu/warm.sh: 150 FP4 kernels); the fp8 peer compiles on the device meanwhile.
set -uo pipefail
source scripts/device_env.sh
source scripts/gpu/job.sh fp4m
D=packages/deepgemm
for mnk in "64 7168 2048" "128 7168 2048" "64 2112 7168" "128 2112 7168" "64 4096 7168" "128 4096 7168"; do
  timeout 30 python3 dg_fp8_warm.py $mnk > /dev/null 2>> "$O/dg_fp8_warm.log" &
done
# 1. the dec kernel vs the float64 reference (GPU tests): A = planned configurations, B = the A/B variants (multicast)
tests "$(left 28)" tests.log -n 0 $D/tests/test_fp4_dec.py -k "not variants"
TA=$?
tests "$(left 38)" tests_variants.log -n 0 $D/tests/test_fp4_dec.py -k variants
TB=$?
wait; el "deepgemm fp8 warm done ($(grep -c Error "$O/dg_fp8_warm.log" 2>/dev/null) errors)"
NCU="--clock-control none --kernel-name regex:gemm_sm90|fp4_wgmma|fp4_dec --section SpeedOfLight --section Occupancy"
NCU="$NCU --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats"
NCU="$NCU --metrics dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed"
# 2. ncu at M = 128 (4096 x 7168, 2112 x 7168): deepgemm fp8 vs the FP4 wgmma kernels (bf16: the default; e4m3), fp8 at
#    M = 64; then the dec kernel (only if its tests passed: a wrong kernel may hang)
CASES=peer_fp8_128,peer_fp8_128_2112,wgmma_128,wgmma_128_2112,wgmma_e4m3_128,wgmma_e4m3_128_2112,peer_fp8_64
[ "$TA" -eq 0 ] && CASES="$CASES,dec_128,dec_128_2112,dec_e4m3_128,dec_e4m3_128_2112,dec_e4m3_64"
# shellcheck disable=SC2086
STEP_LINES=5 step "$(left 58)" ncu.log ncu $NCU python3 $D/benchmarks/bench_fp4.py --ncu-launch --ncu-cases "$CASES"
ONLY=bf16_fp4_auto,fp8_fp4,fp8_fp4_wgmma,cublas_bf16,deepgemm_fp8
V=""
if [ "$TA" -eq 0 ]; then
  ONLY="$ONLY,bf16_fp4_dec,fp8_fp4_dec"
  V="bdec64:bf16_fp4_dec:64,128:DEEPGEMM_FP4_DEC_BN=64;bdec128:bf16_fp4_dec:64,128:DEEPGEMM_FP4_DEC_BN=128"
  V="$V;bdec32s2:bf16_fp4_dec:64,128:DEEPGEMM_FP4_DEC_BN=32,DEEPGEMM_FP4_DEC_SPLITS=2"
  V="$V;fdec64:fp8_fp4_dec:64,128:DEEPGEMM_FP4_DEC_BN=64;fdec32s2:fp8_fp4_dec:64,128:DEEPGEMM_FP4_DEC_BN=32,DEEPGEMM_FP4_DEC_SPLITS=2"
  if [ "$TB" -eq 0 ]; then
    V="$V;bdecmc:bf16_fp4_dec:64,128:DEEPGEMM_FP4_DEC_MCAST=2;fdecmc:fp8_fp4_dec:64,128:DEEPGEMM_FP4_DEC_MCAST=2"
    V="$V;bdecmc4:bf16_fp4_dec:64,128:DEEPGEMM_FP4_DEC_MCAST=4;fdecmc4:fp8_fp4_dec:64,128:DEEPGEMM_FP4_DEC_MCAST=4"
  fi
fi
# 3. bench at the six M = 64 / 128 rows (L2 flushed and CUDA graph), ours vs cuBLAS bf16 and deepgemm fp8, same run
STEP_LINES=20 step "$(left 75)" bench.log python3 $D/benchmarks/bench_fp4.py --out "$O/bench" --ms 64,128 \
  --only "$ONLY" --variants "$V"
el end
