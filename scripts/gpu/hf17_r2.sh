#!/bin/bash
# hf17 (issue 17) R2 on the H200 (final figures). The tree at /tmp/hf17_tree with the kernel cache warmed on the
# CPU machine (NVRTC 13.0, same header paths) and its key carried. 1. bench_models prefill + decode (variants
# timed in interleaved rounds): plain vs bf16 without / with the default fused RMSNorm, + fused MLP, + q/k/v
# groups, fp8 (default: norm + its fp8 cast), fp8 with every fusion  2. torch.compile prefill: plain vs bf16 vs fp8
# 3. the umbrella GPU tests  4. top kernels of the bf16 prefill variants (where the time goes).
set -uo pipefail
O=$JOB_OUT; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
rm -rf /tmp/hf17_tree && mkdir -p /tmp/hf17_tree && cp -a . /tmp/hf17_tree/ && cd /tmp/hf17_tree || exit 1
source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
export TILESTACK_CACHE_DIR=/tmp/hf17_cache TILESTACK_CACHE_KEY_FILE=/tmp/hf17_key/cache.key
mkdir -p -m 700 /tmp/hf17_key /tmp/hf17_cache && install -m 600 hf17_cache.key /tmp/hf17_key/cache.key
[ -f hf17_cache.tgz ] && tar xzf hf17_cache.tgz -C /tmp/hf17_cache --no-same-owner && chmod -R go-rwx /tmp/hf17_cache
el "cache unpacked: $(find /tmp/hf17_cache -name '*.pack' | wc -l) kernels"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
F="^\[transformers\]|Warning|warn"
left() { echo $(( $1 - $(date +%s) + T0 )); }
timeout 45 python3 benchmarks/bench_models.py --only prefill,decode \
  --variants bf16_nonorm,bf16,bf16_norm_mlp,fp8,fp8_all --budget-s 44 \
  --json $O/bench_prefill_decode.json > $O/bench_prefill_decode.log 2>&1
el "prefill/decode rc=$?"; grep -vE "$F" $O/bench_prefill_decode.log | cut -c1-320 | head -44
L=$(left 73); [ $L -gt 10 ] && timeout $L python3 benchmarks/bench_models.py --only compile --variants fp8,bf16 \
  --budget-s 80 --json $O/bench_compile.json > $O/bench_compile.log 2>&1
el "compile rc=$?"; grep -vE "$F" $O/bench_compile.log | cut -c1-300 | head -14
L=$(left 88); [ $L -gt 6 ] && timeout $L python3 -m pytest -q -n 4 -p no:cacheprovider -m gpu -rfE tests/test_norm.py \
  tests/test_fusions_gpu.py tests/test_bf16_choice.py tests/test_register_optimizations.py packages/hal/tests/test_bench.py \
  -k "not fp4" > $O/gpu_tests.log 2>&1
el "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed|Error" $O/gpu_tests.log | head -20
L=$(left 90); [ $L -gt 4 ] && timeout $L python3 benchmarks/bench_models.py --only kernels --kernels-of prefill \
  --variants bf16_nonorm,bf16_norm_mlp --budget-s 60 --json $O/bench_kernels.json > $O/bench_kernels.log 2>&1
el "kernels rc=$?"; grep -vE "$F" $O/bench_kernels.log | cut -c1-200 | head -90
el end
