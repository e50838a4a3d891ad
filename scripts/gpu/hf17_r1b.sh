#!/bin/bash
# hf17 (issue 17) second H200 round (10:25). As hf17_r1.sh: the tree at /tmp/hf17_tree with the kernel cache
# warmed on the CPU machine (NVRTC 13.0) and its key. 1. bench_models prefill + decode: plain vs bf16 / +fuse_norm /
# all fusions (norm, mlp, qkv) / fp8 / fp8 all  2. GPU tests of the fusions, the fp8 RMSNorm cast, capture_graph
# 3. torch.compile prefill: plain vs fp8  4. top kernels of the bf16 prefill variants  5. the cache back.
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
timeout 30 python3 benchmarks/bench_models.py --only prefill,decode --variants bf16,bf16_norm,bf16_all,fp8,fp8_all \
  --budget-s 29 --json $O/bench_prefill_decode.json > $O/bench_prefill_decode.log 2>&1
el "prefill/decode rc=$?"; grep -vE "$F" $O/bench_prefill_decode.log | cut -c1-300 | head -40
L=$(left 52); [ $L -gt 6 ] && timeout $L python3 -m pytest -q -n 4 -p no:cacheprovider -m gpu -rfE tests/test_norm.py \
  tests/test_fusions_gpu.py packages/hal/tests/test_bench.py > $O/gpu_tests.log 2>&1
el "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed|Error" $O/gpu_tests.log | head -20
L=$(left 72); [ $L -gt 8 ] && timeout $L python3 benchmarks/bench_models.py --only compile --variants fp8 --budget-s 70 \
  --json $O/bench_compile.json > $O/bench_compile.log 2>&1
el "compile rc=$?"; grep -vE "$F" $O/bench_compile.log | cut -c1-300 | head -10
L=$(left 80); [ $L -gt 5 ] && timeout $L python3 benchmarks/bench_models.py --only kernels --kernels-of prefill \
  --variants bf16,bf16_norm,bf16_all --budget-s 70 --json $O/bench_kernels.json > $O/bench_kernels.log 2>&1
el "kernels rc=$?"; grep -vE "$F" $O/bench_kernels.log | cut -c1-200 | head -90
tar czf $O/hf17_cache_r1b.tgz -C /tmp/hf17_cache . && el "cache saved: $(du -h $O/hf17_cache_r1b.tgz | cut -f1)"
el end
