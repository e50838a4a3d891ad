#!/bin/bash
# Replays the job's set-up on the CPU machine (the lead's rsync copy of /work/wt/sel15 + /work/gpuq/sel15/*, then
# scripts/gpu/job.sh's copy to /tmp/sel15_tree, cache + key unpacked) and asks for every kernel again with NVRTC
# 13.0: each must be a hit.
set -uo pipefail
rm -rf /tmp/sel15_carry_sim /tmp/sel15_check_out && mkdir -p /tmp/sel15_carry_sim /tmp/sel15_check_out
rsync -a --delete --exclude .git --exclude .cache-tilestack --exclude .hypothesis --exclude __pycache__ \
  --exclude .pytest_cache --exclude .ruff_cache --exclude docs /work/wt/sel15/ /tmp/sel15_carry_sim/
cp /work/gpuq/sel15/* /tmp/sel15_carry_sim/
cd /tmp/sel15_carry_sim && source /work/venv/bin/activate
export JOB_OUT=/tmp/sel15_check_out LD_LIBRARY_PATH=/tmp/nvrtc130/x/nvidia/cu13/lib
source scripts/gpu/job.sh sel15
LD_PRELOAD=/tmp/nvrtc130/x/nvidia/cu13/lib/libnvrtc.so.13 nice python3 warm_cache.py | tee /tmp/sel15_check.log
grep -q ": built" /tmp/sel15_check.log && echo "SOME BUILT (the carried cache misses them)" || echo "ALL HITS"
