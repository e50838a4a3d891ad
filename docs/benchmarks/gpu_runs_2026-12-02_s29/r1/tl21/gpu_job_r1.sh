#!/bin/bash
# tl21 (issue 21, session 29), round 1: why our flash-attention forward stays under SDPA's (FlashAttention-2), and the
# first fix. (1) ncu of our per-shape default kernels and SDPA's at b4 h32 s4096 d128 fp16, full and causal, with the
# session-29 fast softmax forms (cuda_fast_exp2 + cuda_fmnmx + cuda_tree_reduce) beside them; (2) interleaved A/B of the
# four FA forms of FA_DEFAULTS with and without the fast forms vs SDPA, 4 shapes, 3 rounds; (3) their GPU tests.
# ~75 s. Kernel cache warmed on the CPU with NVRTC 13.0 (tl21_cache.tgz / .key, commit in COMMIT).
set -uo pipefail
source scripts/device_env.sh
source scripts/gpu/job.sh tl21
B=packages/tilelang/benchmarks/bench_cuda.py
P=packages/tilelang/benchmarks/cuda_probe.py
NCU_SECTIONS=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats
              --section SchedulerStats --section ComputeWorkloadAnalysis --section SourceCounters)
STEP_LINES=6 step 24 ncu_run.log ncu --clock-control none -k 'regex:tl_main|flash|fmha|sdpa' -c 5 "${NCU_SECTIONS[@]}" \
  --import-source no -f -o "$O/fa" python3 $P ncu fa_ovppsp2 fa_ovppspfm2 fa_sdpa facausal_ovpp3 facausal_sdpa
if [ -f "$O/fa.ncu-rep" ]; then
  timeout 8 ncu -i "$O/fa.ncu-rep" --page details > "$O/ncu.txt" 2>&1
  timeout 8 ncu -i "$O/fa.ncu-rep" --page raw --csv > "$O/ncu_raw.csv" 2>&1
  timeout 10 ncu -i "$O/fa.ncu-rep" --page source --csv --print-source sass > "$O/ncu_source.csv" 2>&1
  gzip -f "$O/ncu_source.csv"
  grep -E "tl_main|flash_fwd|fmha|  Duration|Compute \(SM\) Throughput|Registers Per Thread|Warp Cycles Per Issued|Issue Slots Busy|Achieved Active Warps|No Eligible" \
    "$O/ncu.txt" | cut -c1-150 | head -70
  python3 - "$O/ncu_raw.csv" <<'PY' 2>&1 | tee "$O/ncu_stalls.txt"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = rows[0]
name_col = head.index("Kernel Name") if "Kernel Name" in head else 4
for r in rows[2:]:
    if len(r) != len(head):
        continue
    m = dict(zip(head, r))
    stalls = []
    for k, v in m.items():
        if k.startswith("smsp__average_warps_issue_stalled_") and k.endswith("_per_issue_active.ratio"):
            try:
                stalls.append((float(v.replace(",", "")), k[len("smsp__average_warps_issue_stalled_"):-len("_per_issue_active.ratio")]))
            except ValueError:
                pass
    tensor = {k: v for k, v in m.items() if "tensor" in k and "pct" in k}
    print(r[name_col][:60], "| top stalls (cycles per issue):", ", ".join(f"{n} {v:.2f}" for v, n in sorted(stalls, reverse=True)[:7]))
    print("   tensor:", "; ".join(f"{k}={v}" for k, v in list(tensor.items())[:6]))
PY
  gzip -f "$O/ncu_raw.csv"
fi
STEP_LINES=0 step "$(left 64)" bench.log python3 $B --ab 3 --replays 3 --set s29 --only fa --warm-cache --out "$O"
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
T=packages/tilelang/tests/test_cuda.py
IDS=()
for c in False True; do for f in wsfm ovppfm ovppspfm povppspfm pppfm ovppsp; do IDS+=("$T::test_fa_pipelined_ws_gpu[$c-$f]"); done; done
tests "$(left 76)" gpu_tests.log -n 0 --tb=short "${IDS[@]}"
el end
