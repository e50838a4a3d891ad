"""Summarize `ncu --page raw --csv` of profile_ncu.py's launches: one row per kernel.

    python packages/deepgemm/benchmarks/summarize_ncu.py deepgemm_ncu_raw.csv [--json out.json]

Prints, per kernel: duration, SM clock, tensor-pipe utilization (cycles active, % of peak), DRAM and
L2 throughput, L2 hit rate, shared-memory bank conflicts (loads / stores), occupancy, registers and
the top warp-stall reasons (stall cycles per issued instruction, summed over the warps).
"""

from __future__ import annotations

import argparse
import csv
import json
import re

LABELS = {
    # profile_ncu.CASES launch order, then the peers in order
    0: "dense_fp8_4096x4096x7168", 1: "dense_bf16_4096x4096x7168", 2: "contig_fp8_4x8192x4096x7168",
    3: "masked_fp8_1x1024x4096x7168", 4: "masked_fp8_1x1024x7168x2048", 5: "small_fp8_128x4096x7168",
    6: "small_fp8_64x2112x7168", 7: "small_bf16_128x2112x7168",
}
PEERS = ["dense_fp8_4096x4096x7168", "dense_bf16_4096x4096x7168", "small_fp8_128x4096x7168",
         "small_fp8_64x2112x7168", "small_bf16_128x2112x7168"]
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return float("nan")


def summarize(path: str) -> list[dict]:
    rows = list(csv.reader(open(path)))
    hdr, data = rows[0], rows[2:]
    col = {h: i for i, h in enumerate(hdr)}
    out = []
    ours = peer = 0
    for d in data:
        name = d[col["Kernel Name"]]
        if "deepgemm::gemm_sm90" in name:
            label, ours = LABELS.get(ours, f"ours_{ours}"), ours + 1
        else:
            label, peer = f"peer_{PEERS[peer] if peer < len(PEERS) else peer}", peer + 1

        def g(metric: str, d=d) -> float:
            return num(d[col[metric]]) if metric in col else float("nan")

        stalls = {m.group(1): num(d[i]) for h, i in col.items() if (m := STALL.fullmatch(h))}
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:4]
        out.append({
            "case": label,
            "kernel": name.split("(")[0][:110],
            "duration_us": g("gpu__time_duration.sum") * 1e3,  # ncu reports ms
            "sm_clock_ghz": g("gpc__cycles_elapsed.avg.per_second"),  # GHz
            "tensor_pipe_pct": g("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
            "tensor_pipe_elapsed_pct": g("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"),
            "dram_pct": g("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
            "l2_pct": g("lts__throughput.avg.pct_of_peak_sustained_elapsed"),
            "l2_hit_pct": g("lts__t_sector_hit_rate.pct"),
            "smem_conflicts_ld": g("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
            "smem_conflicts_st": g("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"),
            "warps_active_pct": g("sm__warps_active.avg.pct_of_peak_sustained_active"),
            "regs": g("launch__registers_per_thread"),
            "fma_pipe_pct": g("sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"),
            "alu_pipe_pct": g("sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"),
            "top_stalls": {k: round(v, 2) for k, v in top},
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw_csv")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = summarize(args.raw_csv)
    print("| case | us | tensor pipe % (active / elapsed) | DRAM % | L2 % | L2 hit % | smem conflicts ld / st | "
          "warps % | regs | FMA % | top stalls (cycles per issue) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        stalls = ", ".join(f"{k} {v}" for k, v in r["top_stalls"].items())
        print(f"| {r['case']} | {r['duration_us']:.1f} | {r['tensor_pipe_pct']:.1f} / {r['tensor_pipe_elapsed_pct']:.1f} | "
              f"{r['dram_pct']:.1f} | {r['l2_pct']:.1f} | {r['l2_hit_pct']:.1f} | {r['smem_conflicts_ld']:.0f} / "
              f"{r['smem_conflicts_st']:.0f} | {r['warps_active_pct']:.1f} | {r['regs']:.0f} | {r['fma_pipe_pct']:.1f} | {stalls} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
