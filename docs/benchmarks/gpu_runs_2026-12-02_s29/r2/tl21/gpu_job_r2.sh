#!/bin/bash
# tl21 (issue 21, session 29), round 2: the decisive A/B for the per-shape FA defaults. Round 1 (ncu: SDPA is cuDNN's
# persistent wgmma kernel; ours spent ~5-9 % of its samples in the epilogue's IEEE divisions and ~10-16 % once per tile)
# made the fast softmax forms (cuda_fast_exp2 + cuda_fmnmx + cuda_tree_reduce) 1.07-1.09x the previous forms; this
# round adds cuda_fast_div ("fmd" = tl.enable_fast_math). (1) interleaved A/B vs SDPA and the previous forms, 4
# shapes, 3 rounds; (2) every form of test_fa_pipelined_ws_gpu (the previous ones and the fast ones); (3) a short ncu
# of the causal fmd kernel and SDPA's. ~70 s. Kernel cache warmed with NVRTC 13.0 (tl21_cache.tgz / .key, COMMIT).
set -uo pipefail
source scripts/device_env.sh
source scripts/gpu/job.sh tl21
B=packages/tilelang/benchmarks/bench_cuda.py
P=packages/tilelang/benchmarks/cuda_probe.py
STEP_LINES=0 step 40 bench.log python3 $B --ab 3 --replays 3 --set s29b --only fa --warm-cache --out "$O"
el "$(grep -c 'round .* done' "$O/bench.log") rounds"
python3 - "$O/tilelang_cuda.json" <<'PY' 2>&1 | tee "$O/summary.txt"
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
slow = [r for r in rows if r.get("compile_cold_s", 0) > 0.2]
print(f"{len(rows)} rows; compiles > 0.2 s (cache misses): {len(slow)}")
peer = {(tuple(r["shape"]), r.get("causal")): r["ms"] for r in rows if r["impl"] == "sdpa"}
for r in rows:
    p = peer.get((tuple(r["shape"]), r.get("causal")))
    print(f"{r['impl']:14s} {'x'.join(map(str, r['shape']))}{' causal' if r.get('causal') else ''} "
          f"{r.get('num_stages', '')} st.: {r['tflops']:.0f} TFLOP/s {p / r['ms'] if p else 0:.3f}x SDPA, "
          f"err {r.get('max_abs_err', float('nan')):.1e} rounds {[round(x, 3) for x in r['round_ms']]}")
PY
tests "$(left 66)" gpu_tests.log -n 0 --tb=short packages/tilelang/tests/test_cuda.py::test_fa_pipelined_ws_gpu
STEP_LINES=4 step "$(left 76)" ncu_run.log ncu --clock-control none -k 'regex:tl_main|flash|fmha|sdpa' -c 3 \
  --section SpeedOfLight --section WarpStateStats --section Occupancy -f -o "$O/fa2" \
  python3 $P ncu facausal_ovfmd3 facausal_sdpa fa_ovppspfmd2
if [ -f "$O/fa2.ncu-rep" ]; then
  timeout 5 ncu -i "$O/fa2.ncu-rep" --page details > "$O/ncu.txt" 2>&1
  grep -E "tl_main|cudnn|  Duration|Compute \(SM\) Throughput|Warp Cycles Per Issued|Issue Slots Busy" "$O/ncu.txt" | cut -c1-150
fi
el end
