#!/bin/bash
# dg18 (issue 18, bf16 M = 128 with C; the fp32-C cuBLAS baseline), one H200/H100, ~70 s. Kernel cache warmed on the
# CPU (dg18_cache.tgz: 19 kernels of the tests and the sweep, NVRTC 13.0); the upstream prewarm compiles its own (16
# processes, as s29).
set -uo pipefail; source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
source scripts/gpu/job.sh dg18
D=packages/deepgemm
tar xzf upstream.tgz 2>/dev/null || el "no upstream.tgz: the upstream steps will fail"
# 1. GPU tests: the fused fp32-C baseline (no elementwise kernel), the new cluster default at 128x4096x7168 with C
#    (reference + bitwise vs par_reduce), the 32768x512 candidate tiles (reference), the bf16-C baseline test.
tests 22 gpu_tests.log -n 0 $D/tests/test_compat.py $D/tests/test_splitk.py $D/tests/test_c_epilogue.py \
  -k "cublaslt_baseline or cluster_rule or wide_n"
# 2. vs cuBLAS (torch.mm / addmm_) in the same run, flushed + graph: 128x32768x512 with and without C: the default
#    (C_TMA 128x256, one wave) vs persistent 128x128 / 128x64 / 128x96 / 64x256 and the tile kernel; 128x4096x7168
#    with and without C: the default vs plan_par / plan_cluster (the rule's class; no C decides extending it).
STEP_LINES=8 step 20 sweep.log python3 $D/benchmarks/sweep_small_m.py --graph --m 128 --acc 1,0 \
  --nk 32768x512,4096x7168 --persistent-tiles 128x128,128x64,128x96,64x256 --plans plan_par,plan_cluster \
  --jobs 16 --out "$O" --name sweep.json
# 3. DeepGEMM's test_bf16.test_gemm (75 cases: the cluster default, the fair fp32-C baseline of the TN rows)
R=$D/scripts/run_upstream_tests.py T=upstream/DeepGEMM/tests
mkdir -p "$O/up"
STEP_LINES=3 step 15 up_prewarm.log python3 $R --tests $T --run test_bf16.test_gemm --prewarm-only --jobs 16 \
  --out "$O/up/pre.json"
STEP_LINES=3 step "$(( $(left 78) < 36 ? $(left 78) : 36 ))" up_test_bf16.log python3 $R --tests $T \
  --out "$O/up/test_bf16.json" --run test_bf16.test_gemm
grep -E "acc=1" "$O"/up/test_bf16.test_gemm.log 2>/dev/null | grep -E "m=   128|FP32" | cut -c1-140
el end
