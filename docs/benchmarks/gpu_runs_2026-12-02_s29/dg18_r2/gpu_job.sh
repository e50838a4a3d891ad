#!/bin/bash
# dg18 round 2 (issue 18): the new defaults of round 1's figures, ~65 s on one H200 (or H100). Kernel cache warmed on
# the CPU (dg18_cache.tgz, NVRTC 13.0); the upstream prewarm compiles its own (16 processes).
set -uo pipefail; source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
source scripts/gpu/job.sh dg18
D=packages/deepgemm
tar xzf upstream.tgz 2>/dev/null || el "no upstream.tgz: the upstream steps will fail"
# 1. GPU tests: the default dispatch of 128x32768x512 (128x128 tiles, with / without C) and of 128x4096x7168 (cluster
#    reduction, with / without C) against the reference, the fused fp32-C baseline, the candidate tiles.
tests 22 gpu_tests.log -n 0 $D/tests/test_compat.py $D/tests/test_splitk.py $D/tests/test_c_epilogue.py \
  -k "cublaslt_baseline or cluster_rule or wide_n or tile_rule"
# 2. the defaults vs the plans they replaced (forced), cuBLAS in the same run, flushed + graph
STEP_LINES=8 step 18 sweep.log python3 $D/benchmarks/sweep_small_m.py --graph --m 128 --acc 1,0 \
  --nk 32768x512,4096x7168 --persistent-tiles 128x256,128x64 --plans plan_par,plan_cluster \
  --jobs 16 --out "$O" --name sweep.json
# 3. DeepGEMM's test_bf16.test_gemm (75 cases) under the new defaults, then test_cublaslt_gemm (correctness only)
R=$D/scripts/run_upstream_tests.py T=upstream/DeepGEMM/tests
mkdir -p "$O/up" "$O/upc"
STEP_LINES=3 step 15 up_prewarm.log python3 $R --tests $T --run test_bf16.test_gemm --prewarm-only --jobs 16 \
  --out "$O/up/pre.json"
STEP_LINES=3 step "$(( $(left 70) < 36 ? $(left 70) : 36 ))" up_test_bf16.log python3 $R --tests $T \
  --out "$O/up/test_bf16.json" --run test_bf16.test_gemm
grep -E "m=   128|FP32, acc=1" "$O"/up/test_bf16.test_gemm.log 2>/dev/null | cut -c1-140
STEP_LINES=3 step "$(left 78)" up_cublaslt.log python3 $R --tests $T --correctness-only --out "$O/upc/results.json" \
  --run test_bf16.test_cublaslt_gemm
el end
