# requires: cuda
"""The showcase examples on the GPU against their peers, in one run, same timing for everyone.

    python bench_examples.py [--only fp8,decode,rmsnorm_fp8,gqa] [--out DIR] [--configs all|default]
    python bench_examples.py --best-from EARLIER.json [--top 2]   # only the fastest candidates of a run
    python bench_examples.py --ncu-launch RUN.json                 # one launch of each best kernel, for ncu
    python bench_examples.py --plot RUN.json                       # RUN.png (no GPU)

Rows (H200 targets in issue 21):
- fp8: examples/fp8_gemm.py (1x128 activation / 128x128 weight scales) vs deepgemm.fp8_gemm_nt and
  torch._scaled_mm with the same blockwise scales (per-row scales where this torch refuses
  blockwise; the JSON says which); M=4096, (N, K) in (7168, 2048), (2112, 7168), (24576, 1536).
- decode: examples/paged_decode.py over a kvpool.KVPool's block table (b64 x 4096, GQA 32/8, d128,
  bf16, block 16, blocks of all sequences interleaved) vs kvpool.paged_decode (its hand-written
  kernel) and SDPA on contiguous K/V. (This script, outside tilelang's src, may import kvpool.)
- rmsnorm_fp8: examples/rmsnorm_fp8.py vs the same math in eager torch ops.
- gqa: examples/flash_attention.py with GQA 32/8 vs SDPA (flash backend, enable_gqa).
Each of ours runs the configurations of CONFIGS (`--configs default`: the first one only) and reports the
fastest that matched the reference. Timing: tilehal.bench (CUDA events, median of 30 after 5 warm-up
calls, L2 flushed between calls, host launch work hidden). Writes bench_examples.json into --out.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import tilehal
import tilelang
import torch
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FP8_SHAPES = [(4096, 7168, 2048), (4096, 2112, 7168), (4096, 24576, 1536)]
# fp8: (block_M, block_N, num_stages, threads, swizzle panel[, pass_configs])
PERSISTENT = {"cuda_persistent": True}  # one CTA per SM loops over tiles: the next tile's loads overlap the epilogue
PINGPONG = {"cuda_ws_pingpong": True}  # the consumer warpgroups take turns: one's promotion under the other's wgmma
# (R1 2026-12-02 09:44: (128, 128, 4, 256, 8) without schedules 875 / 855 / 883 TFLOP/s; 128-thread CTAs and
# 128x64 tiles without persistence slower)
FP8_CONFIGS = [(128, 128, 4, 256, 8, PERSISTENT), (128, 128, 4, 256, 8, PINGPONG | PERSISTENT), (128, 128, 5, 256, 8, PINGPONG | PERSISTENT),
               (128, 64, 8, 256, 8, PERSISTENT),  # 128x64: N=2112 in 33 x 32 = 1056 tiles, exactly 8 waves of 132
               # fp8_gemm_overlap_program: two K blocks per stage, the first one's promotion under the second's wgmma
               ("overlap", 128, 128, 3, 256, 8), ("overlap", 128, 128, 2, 256, 8, PERSISTENT),
               ("overlap", 128, 128, 2, 256, 8, PINGPONG | PERSISTENT)]
# decode: (num_split, block_N, num_stages, threads); 32 threads: one warp per CTA, no cross-warp softmax reductions
# (R1 2026-12-02 09:44: the 128-thread CTAs reached 2653 GB/s, split 1 or 2, 2 or 3 stages alike)
DECODE_CONFIGS = [(1, 64, 2, 128), (4, 64, 2, 32), (8, 32, 3, 32), (8, 64, 2, 32), (4, 32, 4, 32), (16, 32, 3, 32),
                  (8, 32, 2, 32), (8, 16, 4, 32)]
TUNE_WITH_AUTOTUNER = True  # --no-autotune: skip the autotuner pass of the fp8 rows


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"tilelang_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def timed(fn) -> float:
    return tilehal.bench(fn, warmup=5, iters=30, flush_l2=True).median_s


def try_time(fn):
    try:
        fn()
        torch.cuda.synchronize()
        return timed(fn)
    except Exception as e:  # a peer refusing a shape is recorded, not hidden
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def add_times(row: dict, t_ours: float | None, peers: dict, unit: str, amount: float) -> dict:
    """row["ours_us"], row["ours_<unit>"] and for each peer (its time in s, or the error text try_time gave)
    "<peer>_us", "<peer>_<unit>" and "ratio_vs_<peer>" (peer time / ours: > 1 is ours faster), or "<peer>_error".
    amount: the row's work in the unit's terms (FLOP / 1e12 for TFLOPS, bytes / 1e9 for GBps)."""
    if t_ours:
        row |= {"ours_us": t_ours * 1e6, f"ours_{unit}": amount / t_ours}
    for p, t in peers.items():
        if isinstance(t, str):
            row[f"{p}_error"] = t
        else:
            row[f"{p}_us"], row[f"{p}_{unit}"] = t * 1e6, amount / t
            if t_ours:
                row[f"ratio_vs_{p}"] = t / t_ours
    return row


def _rows(name: str, makers: list, checkpoint=None) -> list[dict]:
    """One row per maker, in order; checkpoint(name, rows so far), when given, after each (main's writer of the
    partial JSON: a run cut short keeps the rows done)."""
    rows = []
    for make in makers:
        rows.append(make())
        if checkpoint:
            checkpoint(name, rows)
        torch.cuda.empty_cache()
    return rows


def pick(candidates: dict) -> tuple[str | None, float | None]:
    ok = {k: v["s"] for k, v in candidates.items() if "s" in v and v.get("correct")}
    if not ok:
        return None, None
    best = min(ok, key=ok.get)
    return best, ok[best]


# ---------------------------------------------------------------- fp8 block-scaled GEMM


def bench_fp8(configs, checkpoint=None) -> list[dict]:
    import deepgemm

    ex = load("fp8_gemm")
    return _rows("fp8", [lambda s=s: _fp8_shape(deepgemm, ex, *s, configs[s] if isinstance(configs, dict) else configs)
                         for s in FP8_SHAPES], checkpoint)


def fp8_program(ex, cfg: tuple):
    """(program factory, name prefix, the rest of cfg) of a candidate tuple: a leading "overlap" is
    fp8_gemm_overlap_program, "overlap_direct" the same with the epilogue stored from registers."""
    if cfg[0] == "overlap":
        return ex.fp8_gemm_overlap_program, "overlap_", cfg[1:]
    if cfg[0] == "overlap_direct":
        return (lambda *a: ex.fp8_gemm_overlap_program(*a, staged_epilogue=False)), "overlapdirect_", cfg[1:]
    return ex.fp8_gemm_program, "", cfg


def _fp8_no_promotion_program(M, N, K, block_M, block_N, num_stages, threads, swizzle):
    """Timing only (its result is not the scaled product): the example's schedule with the K blocks accumulated
    by the tensor cores directly, no scales and no per-block promotion, to show what the promotion costs."""
    import tilelang.language as T

    @T.prim_func
    def main(A: T.Tensor((M, K), "float8_e4m3"), B: T.Tensor((N, K), "float8_e4m3"), D: T.Tensor((M, N), "bfloat16")):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=threads) as (bx, by):
            A_shared = T.alloc_shared((block_M, 128), "float8_e4m3")
            B_shared = T.alloc_shared((block_N, 128), "float8_e4m3")
            D_shared = T.alloc_shared((block_M, block_N), "bfloat16")
            acc = T.alloc_fragment((block_M, block_N), "float")
            if swizzle:
                T.use_swizzle(panel_size=swizzle)
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, 128), num_stages=num_stages):
                T.copy(A[by * block_M, k * 128], A_shared)
                T.copy(B[bx * block_N, k * 128], B_shared)
                T.gemm(A_shared, B_shared, acc, transpose_B=True)
            T.copy(acc, D_shared)
            T.copy(D_shared, D[by * block_M, bx * block_N])

    return main


def _fp8_shape(deepgemm, ex, m, n, k, configs) -> dict:
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    a8, sfa = ex.per_token_cast_to_fp8(a)
    b8, sfb = ex.per_block_cast_to_fp8(b)
    sfa_t = sfa.T.contiguous()
    ref = ex.reference(a8, sfa, b8, sfb)  # float32, dequantized operands
    flops = 2 * m * n * k
    cands = {}
    for cfg in configs:
        prog, prefix, cfg = fp8_program(ex, cfg)
        tiles, pcfg = (cfg[:-1], cfg[-1]) if isinstance(cfg[-1], dict) else (cfg, None)
        name = prefix + "x".join(map(str, tiles)) + ("_" + "_".join(pcfg) if pcfg else "")
        try:
            t0 = time.perf_counter()
            kern = tilelang.compile(prog(m, n, k, *tiles), out_idx=[-1], target="cuda", pass_configs=pcfg)
            compile_s = time.perf_counter() - t0
            d = kern(a8, b8, sfa_t, sfb)
            diff = ex.calc_diff(d.float(), ref)
            s = timed(lambda kern=kern: kern(a8, b8, sfa_t, sfb))
            cands[name] = {"s": s, "tflops": flops / s / 1e12, "calc_diff": diff, "correct": diff < 1e-4,
                           "compile_s": compile_s}
        except Exception as e:
            cands[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  fp8 {m}x{n}x{k} ours {name}: {cands[name]}", flush=True)
    best, t_ours = pick(cands)
    no_promo = None
    if best is not None and (m, n, k) != FP8_SHAPES[-1]:  # what the promotion costs: the same schedule without it
        try:
            cfg = fp8_config_of(best)
            pcfg = cfg[-1] if isinstance(cfg[-1], dict) else None
            tiles = [x for x in cfg if isinstance(x, int)]
            if isinstance(cfg[0], str):  # overlap programs: the same pipeline depth in K blocks
                tiles[2] *= 2
            kern = tilelang.compile(_fp8_no_promotion_program(m, n, k, *tiles), out_idx=[-1], target="cuda",
                                    pass_configs=pcfg)
            no_promo = {"config": best, "us": timed(lambda: kern(a8, b8)) * 1e6}
        except Exception as e:
            no_promo = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  fp8 {m}x{n}x{k} without promotion: {no_promo}", flush=True)
    tuned = None
    if TUNE_WITH_AUTOTUNER and (m, n, k) == FP8_SHAPES[0]:  # the example's @tilelang.autotune entry: pick, timings
        try:
            t0 = time.perf_counter()
            kt = ex.fp8_gemm_tuned.tune(m, n, k)
            res = ex.fp8_gemm_tuned.last_result
            tuned = {"config": kt.config, "do_bench_ms": res.timings, "tune_s": time.perf_counter() - t0,
                     "us": timed(lambda: kt(a8, b8, sfa_t, sfb)) * 1e6,
                     "calc_diff": ex.calc_diff(kt(a8, b8, sfa_t, sfb).float(), ref)}
        except Exception as e:
            tuned = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  fp8 {m}x{n}x{k} autotune: {tuned}", flush=True)
    d_dg = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    sfa_dg = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    deepgemm.fp8_gemm_nt((a8, sfa_dg), (b8, sfb), d_dg)
    peers = {"deepgemm": try_time(lambda: deepgemm.fp8_gemm_nt((a8, sfa_dg), (b8, sfb), d_dg)),
             # cuBLAS's blockwise recipe wants the activation scales MN-major (deepgemm's layout), sfb.T for B
             "scaled_mm_blockwise": try_time(lambda: torch._scaled_mm(a8, b8.T, scale_a=sfa_dg, scale_b=sfb.T,
                                                                      out_dtype=torch.bfloat16))}
    one_a, one_b = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    peers["scaled_mm_rowwise"] = try_time(lambda: torch._scaled_mm(a8, b8.T, scale_a=one_a, scale_b=one_b,
                                                                   out_dtype=torch.bfloat16))
    row = {"kind": "fp8_gemm", "shape": [m, n, k], "candidates": cands, "best_config": best, "autotune": tuned,
           "no_promotion_same_schedule": no_promo,
           "deepgemm_calc_diff_vs_reference": ex.calc_diff(d_dg.float(), ref)}
    return add_times(row, t_ours, peers, "tflops", flops / 1e12)


# ---------------------------------------------------------------- paged decode


DECODE_SHAPE = (32, 8, 128, 16)  # q heads, kv heads, head_dim, block_size


def build_pool(kvpool, batch, seq_len):
    """A bf16 KVPool holding `batch` sequences of `seq_len` random tokens, appended round-robin in chunks of 8
    blocks (the sequences' blocks interleave in the pool, as in serving)."""
    _, H, D, BS = DECODE_SHAPE
    pool = kvpool.KVPool(1, H, D, batch * seq_len // BS, block_size=BS, dtype=torch.bfloat16, device="cuda",
                         prefix_caching=False, watermark=0.0)
    for b in range(batch):
        pool.add_sequence(b, [0])
    for _ in range(seq_len // (BS * 8)):
        for b in range(batch):
            pool.append(b, BS * 8)
    pool.k_cache.normal_()
    pool.v_cache.normal_()
    return pool


def bench_decode(configs, checkpoint=None, batch=64, seq_len=4096) -> list[dict]:  # one row: no checkpoint
    import kvpool

    ex = load("paged_decode")
    HQ, H, D, BS = DECODE_SHAPE
    pool = build_pool(kvpool, batch, seq_len)
    ids = list(range(batch))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    kc, vc = pool.layer_cache(0)
    torch.manual_seed(0)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    ref = kvpool.paged_decode_reference(q, pool, 0, bt, sl).float()
    kv_bytes = 2 * batch * seq_len * H * D * 2
    cands = {}
    for ns, bn, st, th in configs:
        name = f"split{ns}_n{bn}_s{st}_t{th}"
        try:
            t0 = time.perf_counter()
            kern = tilelang.compile(ex.paged_decode_program(batch, HQ, H, D, kc.shape[0], BS, bt.shape[1], ns, bn,
                                                            16, st, th), out_idx=[-1], target="cuda")
            compile_s = time.perf_counter() - t0
            lse = torch.empty(batch, HQ, ns, device="cuda")
            op = torch.empty(batch, HQ, ns, D, device="cuda")
            out = kern(q, kc, vc, bt, sl, lse, op)
            diff = tilehal.calc_diff(out.float(), ref)
            s = timed(lambda kern=kern, lse=lse, op=op: kern(q, kc, vc, bt, sl, lse, op))
            cands[name] = {"s": s, "GBps": kv_bytes / s / 1e9, "calc_diff": diff, "correct": diff < 1e-4,
                           "max_abs_err": (out.float() - ref).abs().max().item(), "compile_s": compile_s}
        except Exception as e:
            cands[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  decode ours {name}: {cands[name]}", flush=True)
    best, t_ours = pick(cands)
    k_c = torch.stack([pool.gather(0, b)[0].transpose(0, 1) for b in ids]).contiguous()
    v_c = torch.stack([pool.gather(0, b)[1].transpose(0, 1) for b in ids]).contiguous()
    peers = {"kvpool": try_time(lambda: kvpool.paged_decode(q, pool, 0, bt, sl)),
             "sdpa_contiguous": try_time(lambda: F.scaled_dot_product_attention(q[:, :, None], k_c, v_c,
                                                                                enable_gqa=True))}
    row = {"kind": "paged_decode", "case": f"b{batch} x {seq_len}, GQA {HQ}/{H}, d{D}, bf16, block {BS}",
           "kv_bytes": kv_bytes, "candidates": cands, "best_config": best,
           "kvpool_calc_diff_vs_reference": tilehal.calc_diff(kvpool.paged_decode(q, pool, 0, bt, sl).float(), ref)}
    return [add_times(row, t_ours, peers, "GBps", kv_bytes / 1e9)]


# ---------------------------------------------------------------- RMSNorm + fp8 quant


def bench_rmsnorm_fp8(configs_unused, checkpoint=None) -> list[dict]:
    ex = load("rmsnorm_fp8")
    return _rows("rmsnorm_fp8", [lambda m=m, n=n: _rmsnorm_shape(ex, m, n) for m, n in ((4096, 7168), (16384, 4096))],
                 checkpoint)


def _rmsnorm_shape(ex, m, n) -> dict:
    torch.manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    kern = tilelang.compile(ex.rmsnorm_fp8_program(m, n), out_idx=[-2, -1], target="cuda")
    q, s = kern(x, w)
    rq, rs = ex.reference(x, w)
    deq, rdeq = ex.dequantize(q, s), ex.dequantize(rq, rs)
    err = ((deq - rdeq).abs().max() / rdeq.abs().max()).item()
    t_ours = timed(lambda: kern(x, w))
    t_torch = try_time(lambda: ex.reference(x, w))
    nbytes = m * n * 2 + n * 2 + m * n + m * (n // 128) * 4
    row = add_times({"kind": "rmsnorm_fp8", "shape": [m, n], "max_rel_err_dequantized": err,
                     "scale_max_rel_err": ((s - rs).abs() / rs).max().item(),
                     "fp8_codes_differing": (q.float() != rq.float()).float().mean().item()},
                    t_ours, {"torch": t_torch}, "GBps", nbytes / 1e9)
    print(f"  rmsnorm_fp8 {m}x{n}: {row}", flush=True)
    return row


# ---------------------------------------------------------------- GQA flash attention


def bench_gqa(configs_unused, checkpoint=None) -> list[dict]:
    ex = load("flash_attention")
    return _rows("gqa", [lambda c=c: _gqa_case(ex, c) for c in (False, True)], checkpoint)


def _gqa_case(ex, causal) -> dict:
    b, hq, hk, s, d = 4, 32, 8, 4096, 128
    torch.manual_seed(0)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.float16)
    kern = tilelang.compile(ex.flash_attention_fwd(b, hq, s, d, causal, 128, 128, 2, 256, "float16", hq // hk,
                                                   "bhsd"), out_idx=[3], target="cuda")
    o = kern(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    err = (o.float() - ref.float()).abs().max().item()
    flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    t_ours = timed(lambda: kern(q, k, v))
    t_sdpa = try_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
    row = add_times({"kind": "gqa_flash_attention", "case": f"b{b} h{hq}/{hk} s{s} d{d} fp16 causal={causal}",
                     "max_abs_err_vs_sdpa": err}, t_ours, {"sdpa": t_sdpa}, "tflops", flops / 1e12)
    print(f"  gqa {row}", flush=True)
    return row


# ---------------------------------------------------------------- configs back from a JSON's names


def fp8_config_of(name: str) -> tuple:
    """A candidate tuple from its row name ("[overlap_|overlapdirect_]MxNxSxTxP[_cuda_persistent][_cuda_ws_pingpong]")."""
    head = next((h for h in ("overlapdirect_", "overlap_") if name.startswith(h)), "")
    tiles = tuple(int(x) for x in name.removeprefix(head).split("_")[0].split("x"))
    pcfg = {k: True for k in ("cuda_persistent", "cuda_ws_pingpong") if k in name}
    marker = {"overlap_": ("overlap",), "overlapdirect_": ("overlap_direct",), "": ()}[head]
    return marker + tiles + ((pcfg,) if pcfg else ())


def decode_config_of(name: str) -> tuple:
    """(num_split, block_N, num_stages, threads) from "split{ns}_n{bn}_s{st}_t{th}" (R1's names: no _t, 128)."""
    ns, bn, st, *th = name.split("_")
    return int(ns[5:]), int(bn[1:]), int(st[1:]), int(th[0][1:]) if th else 128


def best_configs(path: Path, top: int = 1) -> dict:
    """Per benchmark, the `top` fastest correct candidates of a JSON this script wrote (fp8: per shape)."""
    rows = json.loads(path.read_text())["rows"]

    def ranked(r):
        ok = {k: v["s"] for k, v in r.get("candidates", {}).items() if v.get("correct")}
        return sorted(ok, key=ok.get)[:top]

    out = {}
    if "fp8" in rows:
        out["fp8"] = {tuple(r["shape"]): [fp8_config_of(n) for n in ranked(r)] for r in rows["fp8"] if "shape" in r}
    if "decode" in rows:
        out["decode"] = [decode_config_of(n) for n in ranked(rows["decode"][0])]
    return out


# ---------------------------------------------------------------- one launch of each, for ncu


def ncu_launch(best_json: Path, only: str = "fp8,decode") -> None:
    """Launch once each: our fastest fp8 GEMM (first shape) and paged decode of `best_json` (a JSON this
    script wrote), deepgemm's and kvpool's kernels on the same inputs. Run under
    `ncu --clock-control none -k regex:'tl_main|gemm|paged_decode' ...`."""
    rows = json.loads(best_json.read_text())["rows"]
    if "fp8" in only.split(","):
        _ncu_fp8(rows)
    if "decode" in only.split(","):
        _ncu_decode(rows)


def _ncu_fp8(rows) -> None:
    import deepgemm

    fp8 = load("fp8_gemm")
    m, n, k = FP8_SHAPES[0]
    best = next(r["best_config"] for r in rows["fp8"] if r.get("shape") == [m, n, k])
    prog, _, cfg = fp8_program(fp8, fp8_config_of(best))
    tiles, pcfg = (cfg[:-1], cfg[-1]) if isinstance(cfg[-1], dict) else (cfg, None)
    a8, sfa = fp8.per_token_cast_to_fp8(torch.randn(m, k, device="cuda"))
    b8, sfb = fp8.per_block_cast_to_fp8(torch.randn(n, k, device="cuda"))
    kern = tilelang.compile(prog(m, n, k, *tiles), out_idx=[-1], target="cuda", pass_configs=pcfg)
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    sfa_dg = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
    deepgemm.fp8_gemm_nt((a8, sfa_dg), (b8, sfb), d)  # JIT compile before the profiled launches
    torch.cuda.synchronize()
    print("ncu launch: ours fp8", best, flush=True)
    kern(a8, b8, sfa.T.contiguous(), sfb)
    torch.cuda.synchronize()
    print("ncu launch: deepgemm fp8", flush=True)
    deepgemm.fp8_gemm_nt((a8, sfa_dg), (b8, sfb), d)
    torch.cuda.synchronize()


def _ncu_decode(rows) -> None:
    import kvpool

    pd = load("paged_decode")
    best = rows["decode"][0]["best_config"]
    ns, bn, st, th = decode_config_of(best)
    batch, seq_len = 64, 4096
    HQ, H, D, BS = DECODE_SHAPE
    pool = build_pool(kvpool, batch, seq_len)
    ids = list(range(batch))
    bt, sl = pool.block_table(ids), pool.seq_lens(ids)
    kc, vc = pool.layer_cache(0)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    kern = tilelang.compile(pd.paged_decode_program(batch, HQ, H, D, kc.shape[0], BS, bt.shape[1], ns, bn, 16, st, th),
                            out_idx=[-1], target="cuda")
    lse, op = torch.empty(batch, HQ, ns, device="cuda"), torch.empty(batch, HQ, ns, D, device="cuda")
    kvpool.paged_decode(q, pool, 0, bt, sl)
    torch.cuda.synchronize()
    print("ncu launch: ours decode", best, flush=True)
    kern(q, kc, vc, bt, sl, lse, op)
    torch.cuda.synchronize()
    print("ncu launch: kvpool decode", flush=True)
    kvpool.paged_decode(q, pool, 0, bt, sl)
    torch.cuda.synchronize()


def plot(result: dict, png: Path) -> None:
    """Bars: ours / peer speed ratio (> 1: ours faster) for every row and peer, the issue's 0.95x line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ratios, colors = [], [], []
    palette = {"deepgemm": "tab:blue", "scaled_mm_blockwise": "tab:cyan", "scaled_mm_rowwise": "tab:gray",
               "kvpool": "tab:green", "sdpa_contiguous": "tab:olive", "torch": "tab:orange", "sdpa": "tab:red"}
    for rows in result["rows"].values():
        for r in rows:
            what = r.get("shape", r.get("case", ""))
            what = "x".join(map(str, what)) if isinstance(what, list) else str(what).split(",")[0].replace(
                " s4096 d128 fp16", "")
            for key in (k for k in r if k.startswith("ratio_vs_")):
                peer = key[len("ratio_vs_"):]
                labels.append(f"{r.get('kind', '')} {what}\nvs {peer}")
                ratios.append(r[key])
                colors.append(palette.get(peer, "tab:purple"))
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(labels)), 5))
    bars = ax.bar(range(len(labels)), ratios, color=colors)
    for b, v in zip(bars, ratios):
        ax.text(b.get_x() + b.get_width() / 2, v * 1.02, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.95, color="red", ls="--", lw=0.8, label="target 0.95x (fp8 vs deepgemm, decode vs kvpool)")
    ax.set_xticks(range(len(labels)), labels, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("peer time / our time (log; > 1: ours faster)")
    ax.set_title(f"tilelang examples vs peers, {result['machine']['gpu']}, {result['date']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


BENCHES = {"fp8": (bench_fp8, FP8_CONFIGS), "decode": (bench_decode, DECODE_CONFIGS),
           "rmsnorm_fp8": (bench_rmsnorm_fp8, None), "gqa": (bench_gqa, None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--configs", choices=["all", "default"], default="all")
    ap.add_argument("--best-from", type=Path, default=None, metavar="JSON",
                    help="time only the --top fastest correct candidates per row of JSON (an earlier run)")
    ap.add_argument("--top", type=int, default=1)
    ap.add_argument("--decode", action="append", default=[], metavar="NAME",
                    help="time these decode candidates only (row names, e.g. split1_n64_s2_t128)")
    ap.add_argument("--add-fp8", action="append", default=[], metavar="NAME",
                    help="with --best-from: also time this fp8 candidate (a row name, e.g. overlapdirect_128x128x3x256x8_"
                         "cuda_persistent) on every shape")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-autotune", action="store_true", help="skip the fp8 rows' @tilelang.autotune pass")
    ap.add_argument("--ncu-launch", type=Path, default=None, metavar="JSON",
                    help="launch the fastest configs of JSON once each (and the peers), for ncu; no timing")
    ap.add_argument("--plot", type=Path, default=None, metavar="JSON", help="draw JSON's PNG next to it; no GPU")
    args = ap.parse_args()
    if args.plot:
        return plot(json.loads(args.plot.read_text()), args.plot.with_suffix(".png"))
    if args.ncu_launch:
        return ncu_launch(args.ncu_launch, args.only)
    global TUNE_WITH_AUTOTUNER
    TUNE_WITH_AUTOTUNER = not args.no_autotune
    if not torch.cuda.is_available():
        raise SystemExit("bench_examples needs a CUDA GPU")
    result = {"benchmark": "tilelang examples vs peers", "date": datetime.datetime.now(datetime.timezone.utc)
              .isoformat(timespec="seconds"), "machine": {"gpu": torch.cuda.get_device_name(),
                                                           "torch": torch.__version__, "host": platform.node()},
              "timer": "tilehal.bench: CUDA events, median of 30 after 5 warm-up, L2 flushed, host work hidden",
              "rows": {}}

    def write(name=None, rows=None):  # the JSON so far (+ a row list still being filled)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            now = {**result, "rows": {**result["rows"], **({name: rows} if name else {})}}
            (args.out / "bench_examples.json").write_text(json.dumps(now, indent=1, default=str))

    for name in args.only.split(","):
        fn, cfgs = BENCHES[name]
        if cfgs is not None and args.configs == "default":
            cfgs = cfgs[:1]
        if cfgs is not None and args.best_from is not None:
            cfgs = best_configs(args.best_from, args.top).get(name, cfgs)
            if name == "fp8" and isinstance(cfgs, dict):
                cfgs = {shape: c + [fp8_config_of(x) for x in args.add_fp8] for shape, c in cfgs.items()}
        if name == "decode" and args.decode:
            cfgs = [decode_config_of(x) for x in args.decode]
        t0 = time.perf_counter()
        try:
            result["rows"][name] = fn(cfgs, checkpoint=write)
        except Exception as e:  # one broken row must not lose the others
            traceback.print_exc()
            result["rows"][name] = [{"error": f"{type(e).__name__}: {str(e)[:500]}"}]
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
        write()
    print(f"{'row':<44}{'ours':>12}{'peer':>26}{'ratio':>8}")
    for name, rows in result["rows"].items():
        for r in rows:
            label = f"{r.get('kind', name)} {r.get('shape', r.get('case', ''))}"
            for key in [k for k in r if k.startswith("ratio_vs_")]:
                peer = key[len("ratio_vs_"):]
                print(f"{label[:43]:<44}{r.get('ours_us', 0):>10.1f}us{peer:>16} {r.get(peer + '_us', 0):>7.1f}us"
                      f"{r[key]:>8.3f}")
            if "error" in r:
                print(f"{label[:43]:<44} ERROR {r['error'][:200]}")


if __name__ == "__main__":
    main()
