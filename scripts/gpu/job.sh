# The shared part of a GPU round's job script (one H200, a few tens of seconds a job), sourced from the
# root of the carried tree on the GPU machine:
#
#   #!/bin/bash
#   set -uo pipefail
#   source scripts/gpu/job.sh NAME          # NAME: the helper / job name (lower case, no spaces)
#   step 30 bench.log python3 benchmarks/bench_models.py --only moe --json "$O/bench_moe.json"
#   tests "$(left 60)" gpu_tests.log tests/test_moe.py -k combine
#   el end
#
# Sourcing it copies the tree to /tmp/NAME_tree and continues there (the path its kernel cache was warmed
# at, see scripts/gpu/warm.sh: the cache key holds the include paths), sources scripts/device_env.sh there (when
# the job script already sourced it, as it should first, only its package paths move to the copy), points
# the tilehal cache at /tmp/NAME_cache with the carried key NAME_cache.key and unpacks NAME_cache.tgz when
# the tree has them, and prints the GPU, its clocks and the torch / transformers versions.
#   O            $JOB_OUT (what comes back)
#   el MSG       MSG with the seconds since the start
#   left BUDGET  seconds left until BUDGET seconds after the start (negative once past)
#   step LIMIT LOG CMD...   CMD under `timeout LIMIT` (skipped when LIMIT < 3 s), stdout + stderr into $O/LOG;
#                prints the exit status and the first $STEP_LINES lines of LOG without transformers' and
#                torch's warnings (124: cut by the limit)
#   tests LIMIT LOG PYTEST_ARGS...   step of `python3 -m pytest -q -p no:cacheprovider -m gpu -rfE`, printing
#                only its summary and failure lines (xdist: add -n N yourself; each worker starts torch, ~5 s)
#   save_cache   the cache back as $O/NAME_cache.tgz (dropped when over $CACHE_MAX_BYTES, default 7 MB)
# Errors (a bad name, no JOB_OUT, a failed copy) end the job: it is meant to be sourced by a job script.
# Round-by-round records of the jobs that made the figures live next to the figures, in docs/benchmarks/.

if [ $# -lt 1 ] || [[ ! "$1" =~ ^[a-z0-9_]+$ ]]; then
  echo "scripts/gpu/job.sh: expected a job name of [a-z0-9_] as its argument, got '${1:-}'" >&2
  exit 2
fi
JOB_NAME=$1
O=${JOB_OUT:?scripts/gpu/job.sh: JOB_OUT is not set (the folder whose files come back)}
T0=$(date +%s)
STEP_LINES=${STEP_LINES:-40}
CACHE_MAX_BYTES=${CACHE_MAX_BYTES:-7000000}
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( $1 - $(date +%s) + T0 )); }

step() {
  local limit=$1 log=$2 rc
  shift 2
  if [ "$limit" -lt 3 ]; then el "$log skipped: ${limit} s left"; return 0; fi
  timeout -k 1 "$limit" "$@" > "$O/$log" 2>&1
  rc=$?
  el "$log rc=$rc$([ $rc -eq 124 ] && echo ' (cut at the limit)')"
  grep -vE "^\[transformers\]|Warning|warn" "$O/$log" | cut -c1-320 | head -n "$STEP_LINES"
  return $rc
}

tests() {
  local limit=$1 log=$2 rc
  shift 2
  if [ "$limit" -lt 3 ]; then el "$log skipped: ${limit} s left"; return 0; fi
  timeout -k 1 "$limit" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE "$@" > "$O/$log" 2>&1
  rc=$?
  el "$log rc=$rc$([ $rc -eq 124 ] && echo ' (cut at the limit)')"
  grep -E "FAILED|ERROR|passed|failed|skipped|Error" "$O/$log" | cut -c1-320 | head -n 20
  return $rc
}

save_cache() {
  tar czf "$O/${JOB_NAME}_cache.tgz" -C "/tmp/${JOB_NAME}_cache" . 2>/dev/null
  local size
  size=$(stat -c %s "$O/${JOB_NAME}_cache.tgz" 2>/dev/null || echo 0)
  if [ "$size" -gt "$CACHE_MAX_BYTES" ]; then
    rm -f "$O/${JOB_NAME}_cache.tgz"
    el "cache ($size bytes) over $CACHE_MAX_BYTES: not saved"
  else
    el "cache saved: $size bytes, $(find "/tmp/${JOB_NAME}_cache" -name '*.pack' | wc -l) kernels"
  fi
}

_job_tree=/tmp/${JOB_NAME}_tree
_job_from=$(pwd -P)
if [ "$_job_from" != "$_job_tree" ]; then
  rm -rf "$_job_tree" && mkdir -p "$_job_tree" && cp -a . "$_job_tree/" && cd "$_job_tree" || {
    echo "scripts/gpu/job.sh: could not copy the tree to $_job_tree" >&2; exit 1; }
fi
if [[ ":${PYTHONPATH:-}:" == *":$_job_from/src:"* ]]; then
  # device_env.sh already ran from the carried tree (wheels unpacked, NCCL settings): only its paths move
  export PYTHONPATH=${PYTHONPATH//$_job_from\//$_job_tree/}
else
  source scripts/device_env.sh
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
export TILESTACK_CACHE_DIR=/tmp/${JOB_NAME}_cache TILESTACK_CACHE_KEY_FILE=/tmp/${JOB_NAME}_key/cache.key
mkdir -p -m 700 "/tmp/${JOB_NAME}_key" "$TILESTACK_CACHE_DIR"
if [ -f "${JOB_NAME}_cache.key" ]; then
  install -m 600 "${JOB_NAME}_cache.key" "$TILESTACK_CACHE_KEY_FILE"
fi
if [ -f "${JOB_NAME}_cache.tgz" ]; then
  tar xzf "${JOB_NAME}_cache.tgz" -C "$TILESTACK_CACHE_DIR" --no-same-owner && chmod -R go-rwx "$TILESTACK_CACHE_DIR"
fi
el "job $JOB_NAME at $(pwd), commit $(cat COMMIT 2>/dev/null || echo '?'), cache: $(find "$TILESTACK_CACHE_DIR" -name '*.pack' | wc -l) kernels"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -n 2
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -n 1
python3 -c "import transformers; print('transformers', transformers.__version__)" 2>/dev/null
unset _job_tree _job_from
