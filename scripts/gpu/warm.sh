#!/bin/bash
# Warm, on the CPU machine, the kernel cache a GPU round's job (scripts/gpu/job.sh NAME) will use, so the
# round compiles nothing:
#
#   scripts/gpu/warm.sh NAME TREE CMD...
#
# copies TREE (the folder that will be carried, e.g. /work/main/.carry/NAME) to /tmp/NAME_tree, the path
# job.sh runs it from (the cache key holds the include paths), runs CMD there with the GPU machine's NVRTC
# (13.0: $DEVICE_NVRTC, default /tmp/nvrtc130/x/nvidia/cu13/lib/libnvrtc.so.13; the key holds its version
# too) into /tmp/NAME_cache under a key made for this cache alone (/tmp/NAME_key/cache.key), then writes
# TREE/NAME_cache.tgz and TREE/NAME_cache.key (mode 0600), which job.sh unpacks and installs. CMD is any
# command that compiles the round's kernels without a GPU, e.g.
#   python3 benchmarks/bench_models.py --precompile --warm-only --only moe
#   python3 scripts/gpu/hf17_warm_tests.py        python3 scripts/gpu/grouped_warm.py
#   python3 -m pytest -q -n 0 packages/deepgemm/tests/test_gemv.py -k compile
set -uo pipefail
if [ $# -lt 3 ] || [[ ! "$1" =~ ^[a-z0-9_]+$ ]] || [ ! -d "$2" ]; then
  echo "usage: scripts/gpu/warm.sh NAME TREE CMD... (NAME of [a-z0-9_], TREE a folder); got: $*" >&2
  exit 2
fi
NAME=$1 TREE=$(cd "$2" && pwd -P)
shift 2
NVRTC=${DEVICE_NVRTC:-/tmp/nvrtc130/x/nvidia/cu13/lib/libnvrtc.so.13}
if [ ! -f "$NVRTC" ]; then
  echo "scripts/gpu/warm.sh: DEVICE_NVRTC: expected the GPU machine's libnvrtc.so (13.0), got '$NVRTC' (missing)" >&2
  exit 2
fi
DEST=/tmp/${NAME}_tree
rm -rf "$DEST" "/tmp/${NAME}_cache" && mkdir -p "$DEST" && cp -a "$TREE/." "$DEST/" || exit 1
rm -f "$DEST/${NAME}_cache.tgz" "$DEST/${NAME}_cache.key"
mkdir -p -m 700 "/tmp/${NAME}_key" "/tmp/${NAME}_cache"
rm -f "/tmp/${NAME}_key/cache.key"  # a fresh key: made by tilehal on first use (32 random bytes, 0600)
cd "$DEST" || exit 1
PYTHONPATH=$DEST/src
for p in hal tilelang deepgemm deepep kvpool dataengine; do PYTHONPATH=$DEST/packages/$p/src:$PYTHONPATH; done
export PYTHONPATH TILESTACK_CACHE_DIR=/tmp/${NAME}_cache TILESTACK_CACHE_KEY_FILE=/tmp/${NAME}_key/cache.key
T0=$(date +%s)
# its libnvrtc-builtins sits next to it and is found through the library path
LD_PRELOAD=$NVRTC LD_LIBRARY_PATH=$(dirname "$NVRTC")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$@"
rc=$?
n=$(find "$TILESTACK_CACHE_DIR" -name '*.pack' | wc -l)
echo "warm: rc=$rc, $n kernels in $(( $(date +%s) - T0 )) s"
[ $rc -eq 0 ] || exit $rc
[ -f "$TILESTACK_CACHE_KEY_FILE" ] || { echo "warm: no kernel was compiled (no cache key made)" >&2; exit 1; }
tar czf "$TREE/${NAME}_cache.tgz" -C "$TILESTACK_CACHE_DIR" . && install -m 600 "$TILESTACK_CACHE_KEY_FILE" "$TREE/${NAME}_cache.key"
echo "warm: $TREE/${NAME}_cache.tgz ($(du -h "$TREE/${NAME}_cache.tgz" | cut -f1)) and ${NAME}_cache.key written"
