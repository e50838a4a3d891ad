#!/bin/bash
# grouped (issues 19 + 17) R3 (last, ~30 s) on the H200: final grouped-kernel figures. Kernel cache warmed off the
# device (NVRTC 13.0, scripts/gpu/grouped_warm.py) from /tmp/grouped_tree with the carried key (.kkey: a key made
# for this cache only). Contiguous: serial (today's default) vs producer-fed schedule + overlapped promotion (R2: +7 %
# at 4 x 8192) vs 2-CTA A multicast (grid capped at resident clusters; plain remote release vs .release.cluster);
# masked: default vs producer-fed schedule vs B multicast. Every variant's output is compared with the first's.
set -uo pipefail; source scripts/device_env.sh
O=$JOB_OUT; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/grouped_tree /tmp/grouped_key; mkdir -p /tmp/grouped_tree /tmp/grouped_key; chmod 700 /tmp/grouped_key
cp -a . /tmp/grouped_tree/; cp .kkey/cache.key /tmp/grouped_key/cache.key; chmod 600 /tmp/grouped_key/cache.key
cd /tmp/grouped_tree && source scripts/device_env.sh
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
export TILESTACK_CACHE_DIR=/tmp/grouped_tree/.kcache TILESTACK_CACHE_KEY_FILE=/tmp/grouped_key/cache.key
timeout 27 python3 packages/deepgemm/benchmarks/bench_grouped.py --no-swiglu \
  --variants serial,info_overlap,info_overlap_lean,mcast,mcast_release_cluster --masked-variants default,info,mcast_b \
  --out $O/bench_grouped.json > $O/bench_grouped.log 2>&1
el "grouped bench rc=$?"; grep -vE "Warning|warn" $O/bench_grouped.log | cut -c1-200 | tail -40
