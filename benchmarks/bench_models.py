"""register_optimizations on whole transformers models: the issue-17 target table in one run.

    # on the H200: one device call (~4 minutes), from /work/main with carry [".whl"] (transformers + regex):
    source scripts/device_env.sh && set -o pipefail && timeout 290 python benchmarks/bench_models.py \
        --json $OUT/bench_models.json 2>&1 | tee $OUT/bench_models.log
    # CPU smoke test of every code path (tiny shapes, seconds):
    python benchmarks/bench_models.py --quick

Rows (models built from configs, random weights, bf16 on CUDA; each variant against its peer in the
same run; times are medians of `tilehal.bench`, eager rows with host time included
(`hide_host=False`), CUDA-graph rows the replay; calc_diff of the output against the peer's):

  prefill        Llama-3-8B-shaped, 2 layers, 8 x 512 tokens, eager: plain vs bf16 / fp8 swaps
  decode_eager   same model, batch 64, one token on a 4K StaticCache (random K/V), eager
  decode_graph   the same decode step captured in a CUDA graph (plain captured likewise)
  compile        prefill under torch.compile (inductor), plain compiled vs optimized compiled
  moe            Mixtral-8x7B-shaped MoE blocks (2 layers, hidden 4096, 8 experts top-2, ffn 14336),
                 4096 tokens: transformers' block (its default experts implementation) vs
                 ExpertParallelMoE bf16 / fp8
  profile        tilestack.profile of the prefill model: the markdown report + plot next to --json
  host           host time of one small GEMM (bf16 128 x 7168 x 2048, eager): deepgemm.bf16_gemm_nt,
                 GemmLinear and the tilestack::bf16_gemm_nt op vs cuBLAS (torch.nn.functional.linear)
  gemms          (only when named) the Llama GEMM shapes one by one, deepgemm bf16 / fp8 vs cuBLAS bf16
  kernels        (only when named) the top GPU kernels of every prefill and MoE variant (torch.profiler)

The decode rows also record each variant's host time per eager step and write a cProfile of it
(cprofile_decode_eager_<variant>.txt next to --json). `--precompile` NVRTC-compiles the chosen
sections' dense kernels in a process pool first.

A row that cannot run (no kernel, capture failure, memory, the time budget) is recorded with its
reason; nothing asserts a time. `--budget-s` bounds the whole run (sections after it are skipped).
"""

# requires: cuda   (tilestack bench; the CPU smoke test is --quick)

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
for _p in ("src", *(f"packages/{n}/src" for n in ("hal", "deepgemm", "deepep", "kvpool", "dataengine"))):
    if str(_ROOT / _p) not in sys.path:
        sys.path.insert(0, str(_ROOT / _p))

import tilehal  # noqa: E402
import transformers  # noqa: E402

from tilestack import register_optimizations  # noqa: E402

ROWS: list[dict] = []
T0 = time.perf_counter()
_SAVE: list = []   # [callable] set by main: rewrites the JSON after every row (a run cut short keeps them)


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (smoke test)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--budget-s", type=float, default=220.0, help="skip sections once this much time has passed")
    p.add_argument("--only", help="comma-separated sections: host,prefill,decode,moe,profile,compile,gemms,kernels "
                   "(default: all but gemms,kernels)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the prefill / decode rows")
    p.add_argument("--variants", default="bf16,fp8", help=f"optimized variants of the Llama rows: {','.join(VARIANTS)}")
    p.add_argument("--precompile", action="store_true", help="NVRTC-compile the Llama rows' kernels in parallel first")
    p.add_argument("--warm-only", action="store_true", help="with --precompile: only compile (no GPU needed; e.g. "
                   "with the GPU machine's NVRTC, to carry the cache there), then exit")
    p.add_argument("--workers", type=int, default=12, help="compile processes of --precompile")
    p.add_argument("--kernels-of", default="prefill,moe", help="what the kernels section profiles: prefill,moe")
    return p.parse_args(argv)


def _shapes(quick: bool) -> dict:
    if quick:
        return dict(llama=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512),
                    prefill=(2, 16), decode=(2, 32),
                    moe=dict(hidden_size=256, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2),
                    moe_tokens=64, gemm=(16, 256, 256))
    return dict(llama=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                           max_position_embeddings=8192),
                prefill=(8, 512), decode=(64, 4096),
                moe=dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2),
                moe_tokens=4096, gemm=(128, 7168, 2048))


class Env:
    def __init__(self, args):
        self.quick = args.quick
        self.device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.backend = "cuda" if self.cuda else "cpu"
        self.iters = 2 if args.quick else args.iters
        if args.rounds < 1:
            raise SystemExit(f"--rounds: expected a positive number of rounds, got {args.rounds}")
        self.rounds = args.rounds
        self.budget = args.budget_s
        self.s = _shapes(args.quick)
        self.out_dir = str(Path(args.json).parent) if args.json else "."
        self.variants = [v for v in args.variants.split(",") if v]
        self.kernels_of = set(args.kernels_of.split(","))
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad:
            raise SystemExit(f"--variants: unknown {bad}, expected some of {sorted(VARIANTS)}")

    def bench(self, fn, hide_host=False) -> tilehal.BenchResult:
        return tilehal.bench(fn, warmup=2 if self.quick else 3, iters=self.iters,
                             device="cuda" if self.cuda else "cpu", hide_host=hide_host)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - T0)


def row(workload: str, variant: str, ms: float | None, peer_ms: float | None = None, diff: float | None = None,
        note: str = "", **extra) -> None:
    r = dict(workload=workload, variant=variant, ms=ms, peer_ms=peer_ms,
             speedup=(peer_ms / ms) if ms and peer_ms else None, calc_diff=diff, note=note, **extra)
    ROWS.append(r)
    sp = f"{r['speedup']:.3f}x" if r["speedup"] else "-"
    print(f"{workload:14s} {variant:22s} {ms if ms is not None else float('nan'):10.4f} ms  "
          f"peer {peer_ms if peer_ms is not None else float('nan'):10.4f} ms  {sp:>8s}  "
          f"calc_diff {diff if diff is not None else float('nan'):.2e}  {note}", flush=True)
    for save in _SAVE:
        save()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _llama(env: Env) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**env.s["llama"])
    with torch.device(env.device):
        model = transformers.LlamaForCausalLM(cfg).to(env.dtype)
    return model.eval()


VARIANTS = {"bf16": dict(fp8=False), "fp8": dict(fp8=True), "bf16_nonorm": dict(fp8=False, fuse_norm=False),
            "fp8_nonorm": dict(fp8=True, fuse_norm=False), "bf16_mlp": dict(fp8=False, fuse_mlp=True),
            "fp8_mlp": dict(fp8=True, fuse_mlp=True), "bf16_norm": dict(fp8=False, fuse_norm=True),
            "bf16_norm_mlp": dict(fp8=False, fuse_norm=True, fuse_mlp=True),
            "fp8_norm": dict(fp8=True, fuse_norm=True), "fp8_norm_mlp": dict(fp8=True, fuse_norm=True, fuse_mlp=True),
            "bf16_all": dict(fp8=False, fuse_norm=True, fuse_mlp=True, fuse_qkv=True),
            "fp8_all": dict(fp8=True, fuse_norm=True, fuse_mlp=True, fuse_qkv=True),
            # lm_head left as the model's nn.Linear (cuBLAS), everything under model.* swapped as in bf16 / bf16_mlp:
            # on the H200 deepgemm's lm_head measured 10 % faster alone but the model with it ran 0.85 ms slower
            # (bf16's default since session 28: register_optimizations keeps a bf16 output embedding unless named)
            "bf16_cublas_head": dict(fp8=False, include=["model.*"]),
            # the bf16 default before session 28: the lm_head swapped too, through the per-shape choice
            "bf16_swapped_head": dict(fp8=False, include=["*"]),
            "bf16_mlp_cublas_head": dict(fp8=False, fuse_mlp=True, include=["model.*"]),
            # only the RMSNorms swapped (every Linear stays nn.Linear): what the fused norm alone gives
            "bf16_normonly": dict(fp8=False, fuse_norm=True, include=["*norm*"]),
            # RoPE rotated in place by one kernel in the attention blocks (tilestack.rope; on by default since session
            # 29): the *_norope variants are the defaults before it
            "bf16_norope": dict(fp8=False, fuse_rope=False), "fp8_norope": dict(fp8=True, fuse_rope=False),
            "bf16_rope": dict(fp8=False, fuse_rope=True), "bf16_mlp_rope": dict(fp8=False, fuse_mlp=True, fuse_rope=True),
            "fp8_rope": dict(fp8=True, fuse_rope=True), "fp8_mlp_rope": dict(fp8=True, fuse_mlp=True, fuse_rope=True)}


def _variants(env: Env, base: torch.nn.Module):
    """(name, model or the exception that building it raised) for plain and each of env.variants
    (register_optimizations keywords in VARIANTS; each a deep copy of base, so weights are equal)."""
    yield "plain", base
    for v in env.variants:
        try:
            m = copy.deepcopy(base)
            kw = dict(VARIANTS[v])
            if not env.cuda:
                kw.pop("fuse_mlp", None)
            rep = register_optimizations(m, backend=env.backend, **kw)
        except Exception as e:   # a variant that cannot be built is a result, recorded by the caller
            traceback.print_exc()
            yield f"tilestack_{v}", e
            continue
        kinds = {}
        for d in rep.swapped:
            kinds[d.kind] = kinds.get(d.kind, 0) + 1
        yield f"tilestack_{v} (" + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")", m
        del m
        _free()


def _failed(workload: str, name: str, e: BaseException) -> None:
    if not isinstance(e, Exception):
        raise e
    row(workload, name, None, note=f"failed: {type(e).__name__}: {str(e)[:200]}")


# ----------------------------------------------------------------------------- sections


def _interleaved(env: Env, fns: list) -> list[tuple[float, float, float]]:
    """(median, min, max) ms over env.rounds rounds (--rounds) of env.bench medians of each fn, the fns taking turns
    in every round: a host or clock drift during the section moves every variant alike instead of the ones timed
    last."""
    per: list[list[float]] = [[] for _ in fns]
    for _ in range(1 if env.quick else env.rounds):
        for i, fn in enumerate(fns):
            per[i].append(env.bench(fn).median_s * 1e3)
    return [(sorted(ts)[len(ts) // 2], min(ts), max(ts)) for ts in per]


def sec_prefill(env: Env) -> None:
    b, s = env.s["prefill"]
    base = _llama(env)
    ids = torch.randint(0, base.config.vocab_size, (b, s), device=env.device)
    with torch.no_grad():
        ref = base(ids).logits
        runs = []   # (name, model, calc_diff)
        for name, m in _variants(env, base):
            try:
                if isinstance(m, Exception):
                    raise m
                runs.append((name, m, tilehal.calc_diff(m(ids).logits, ref)))
            except Exception as e:
                traceback.print_exc()
                _failed("prefill", name, e)
        times = _interleaved(env, [lambda m=m: m(ids) for _, m, _ in runs])
        peer = times[0][0] if runs and runs[0][0] == "plain" else None
        for (name, _, diff), (t, lo, hi) in zip(runs, times):
            row("prefill", name, t, peer, diff, f"{b}x{s} eager; median of interleaved rounds "
                f"({lo:.3f}-{hi:.3f} ms)", round_min_ms=lo, round_max_ms=hi)
        del runs
    del base, ref
    _free()


def _static_decode(env: Env, model: torch.nn.Module, b: int, ctx: int):
    """A decode step at position ctx on a StaticCache whose first ctx positions hold random K/V.

    The cache holds exactly ctx + 1 positions: for one query token without an attention mask,
    transformers' SDPA path drops the causal mask in eager mode (attending every cache position)
    but keeps it while a CUDA graph is captured; with no position past ctx both read the same K/V."""
    cache = transformers.StaticCache(config=model.config, max_cache_len=ctx + 1)
    ids = torch.randint(0, model.config.vocab_size, (b, 1), device=env.device,
                        generator=torch.Generator(env.device).manual_seed(3))
    pos = torch.full((1,), ctx, dtype=torch.long, device=env.device)
    pos_ids = pos.view(1, 1).expand(b, 1)

    def step():
        return model(ids, past_key_values=cache, cache_position=pos, position_ids=pos_ids, use_cache=True).logits

    step()                                              # initializes the cache layers
    g = torch.Generator(env.device).manual_seed(4)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.copy_(torch.randn(t.shape, generator=g, device=env.device, dtype=torch.float32).to(t.dtype))
    return step


def _host_profile(env: Env, fn, tag: str, reps: int = 5) -> float:
    """Host time of one eager call (ms), and where it goes: cProfile of `reps` calls, the 25 functions with
    the most own time, written next to --json as cprofile_<tag>.txt."""
    import cProfile
    import io
    import pstats

    if env.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e3
    if env.cuda:
        torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        fn()
    pr.disable()
    if env.cuda:
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
    pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(40)
    Path(env.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(env.out_dir) / f"cprofile_{tag}.txt").write_text(f"{reps} calls\n" + text.getvalue())
    return host


def sec_decode(env: Env) -> None:
    b, ctx = env.s["decode"]
    base = _llama(env)
    with torch.no_grad():
        runs = []   # (name, step, logits)
        for name, m in _variants(env, base):
            try:
                if isinstance(m, Exception):
                    raise m
                step = _static_decode(env, m, b, ctx)
                runs.append((name, step, step().float()))
            except Exception as e:
                traceback.print_exc()
                _failed("decode_eager", name, e)
        times = _interleaved(env, [step for _, step, _ in runs])
        ref = runs[0][2] if runs else None
        peer_e = times[0][0] if runs and runs[0][0] == "plain" else None
        for (name, step, out), (t, lo, hi) in zip(runs, times):
            row("decode_eager", name, t, peer_e, tilehal.calc_diff(out, ref), f"b{b}, {ctx} cached, StaticCache; "
                f"median of interleaved rounds ({lo:.3f}-{hi:.3f} ms)", round_min_ms=lo, round_max_ms=hi,
                host_ms=_host_profile(env, step, f"decode_eager_{name.split()[0]}"))
        peer_g = ref_g = None
        for name, step, _ in runs:
            if not env.cuda:
                row("decode_graph", name, None, note="skipped: CUDA graphs need a GPU")
                continue
            try:
                graph, gout = tilehal.capture_graph(step)
                graph.replay()
                torch.cuda.synchronize()
                tg = env.bench(graph.replay, hide_host=True).median_s * 1e3
                peer_g = tg if peer_g is None else peer_g
                ref_g = gout.float().clone() if ref_g is None else ref_g
                row("decode_graph", name, tg, peer_g, tilehal.calc_diff(gout.float(), ref_g),
                    f"CUDA graph replay; calc_diff vs the plain graph's logits (plain graph vs plain eager: "
                    f"{tilehal.calc_diff(ref_g, ref):.1e})")
                del graph, gout
            except Exception as e:   # a capture failure is a result, recorded with its reason
                row("decode_graph", name, None, note=f"capture failed: {type(e).__name__}: {str(e)[:200]}")
        del runs
    del base
    _free()


def sec_compile(env: Env) -> None:
    """Each variant compiled (inductor, fullgraph), then all of them timed in interleaved rounds (a clock drift
    after the compiles moves every row alike; session 28 timed each right after its own compile)."""
    b, s = env.s["prefill"]
    base = _llama(env)
    ids = torch.randint(0, base.config.vocab_size, (b, s), device=env.device)
    backend = "aot_eager" if env.quick else "inductor"
    with torch.no_grad():
        ref = base(ids).logits
        torch._dynamo.reset()
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(env.variants) + 8)
        runs = []   # (name, compiled model, calc_diff, compile seconds)
        for name, m in _variants(env, base):
            if env.left() < 15:
                row("compile", name, None, note="skipped: time budget")
                continue
            t0 = time.perf_counter()
            try:
                if isinstance(m, Exception):
                    raise m
                cm = torch.compile(m, fullgraph=True, backend=backend)
                out = cm(ids).logits
            except Exception as e:
                row("compile", name, None, note=f"compile failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            runs.append((name, cm, tilehal.calc_diff(out, ref), time.perf_counter() - t0))
        times = _interleaved(env, [lambda cm=cm: cm(ids) for _, cm, _, _ in runs])
        peer = times[0][0] if runs and runs[0][0] == "plain" else None
        for (name, _, diff, ct), (t, lo, hi) in zip(runs, times):
            row("compile", name, t, peer, diff, f"{backend}, fullgraph, compiled in {ct:.0f} s; median of "
                f"interleaved rounds ({lo:.3f}-{hi:.3f} ms)", round_min_ms=lo, round_max_ms=hi)
    del base
    _free()


class _MoEStack(torch.nn.Module):
    """Decoder-style MoE layers without attention: h = h + block(rmsnorm(h)), as in Mixtral's layers."""

    def __init__(self, blocks, hidden: int):
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(hidden, eps=1e-5) for _ in blocks)
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, h):
        for norm, block in zip(self.norms, self.blocks):
            h = h + block(norm(h))
        return h


def _moe_stack(env: Env):
    """(2 Mixtral MoE layers with weights ~ N(0, 0.02), the input, the experts implementation's name)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(**env.s["moe"])
    torch.manual_seed(0)
    with torch.device(env.device):
        stack = _MoEStack([MixtralSparseMoeBlock(cfg) for _ in range(2)], cfg.hidden_size).to(env.dtype)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if "norms" not in name:
                p.normal_(0, 0.02)
    impl = getattr(cfg, "_experts_implementation", None) or "default"
    x = torch.randn(1, env.s["moe_tokens"], cfg.hidden_size, device=env.device, dtype=env.dtype)
    return stack, x, impl


def _moe_peer_grouped_mm(stack: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of the stack whose experts run transformers' own "grouped_mm" implementation (torch's grouped
    GEMM), a context row: the issue's peer is the block as built (its default experts code)."""
    peer = copy.deepcopy(stack)
    for blk in peer.blocks:
        cfg = copy.copy(blk.experts.config)
        cfg._experts_implementation = "grouped_mm"
        blk.experts.config = cfg
    return peer


def sec_moe(env: Env) -> None:
    stack, x, impl = _moe_stack(env)
    with torch.no_grad():
        ref = stack(x)
        peer = env.bench(lambda st=stack: st(x)).median_s * 1e3
        row("moe", "transformers", peer, peer, 0.0, f"{env.s['moe_tokens']} tokens, 2 layers, experts impl {impl}",
            host_ms=_host_profile(env, lambda st=stack: st(x), "moe_transformers", reps=2))
        if env.cuda:
            try:
                gm = _moe_peer_grouped_mm(stack)
                out = gm(x)
                t = env.bench(lambda gm=gm: gm(x)).median_s * 1e3
                row("moe", "transformers grouped_mm", t, peer, tilehal.calc_diff(out - x, ref - x),
                    "context row: transformers' experts_implementation='grouped_mm' (torch grouped GEMM)")
                del gm
            except Exception as e:
                row("moe", "transformers grouped_mm", None, note=f"failed: {type(e).__name__}: {str(e)[:200]}")
            _free()
        for name, fp8 in (("ExpertParallelMoE bf16", False), ("ExpertParallelMoE fp8", True)):
            try:
                ours = copy.deepcopy(stack)
                rep = register_optimizations(ours, backend=env.backend, fp8=fp8)
                out = ours(x)
                t = env.bench(lambda ours=ours: ours(x)).median_s * 1e3
                host = _host_profile(env, lambda ours=ours: ours(x), f"moe_{'fp8' if fp8 else 'bf16'}", reps=2)
                # One block on the same input separates arithmetic from routing: in the second layer a
                # token whose top-2 is a near-tie may pick another expert after any rounding difference.
                n0 = stack.norms[0](x)
                r1, o1 = stack.blocks[0](n0), ours.blocks[0](n0)
                one = tilehal.calc_diff(o1, r1)
                g = stack.blocks[1].gate
                ti = g(stack.norms[1](x + r1))[2].sort(-1).values
                to = g(stack.norms[1](x + o1))[2].sort(-1).values
                flips = (ti != to).any(-1).float().mean().item()
                top = _top_kernels(lambda ours=ours: ours(x), n=14) if env.cuda else []
                row("moe", name, t, peer, tilehal.calc_diff(out - x, ref - x),
                    f"{len(rep.swapped)} blocks swapped; calc_diff of the MoE part (out - x); one block on the "
                    f"same input {one:.1e}; tokens whose layer-2 top-2 differs {100 * flips:.2f} %; host "
                    f"{host:.2f} ms/forward", calc_diff_one_block=one, layer2_routing_flips=flips, host_ms=host,
                    top=top)
                for k in top:
                    print(f"    {k['us']:9.1f} us  x{k['calls']:<3d} {k['kernel']}", flush=True)
                if env.cuda:
                    _moe_graph_row(env, ours, x, peer, name)
                del ours
            except Exception as e:
                traceback.print_exc()
                row("moe", name, None, note=f"failed: {type(e).__name__}: {str(e)[:200]}")
            _free()
    del stack
    _free()


def _moe_graph_row(env: Env, ours: torch.nn.Module, x: torch.Tensor, peer: float, name: str) -> None:
    """The optimized stack captured in a CUDA graph (its MoE path has no host synchronization)."""
    try:
        graph, gout = tilehal.capture_graph(lambda: ours(x))
        graph.replay()
        torch.cuda.synchronize()
        tg = env.bench(graph.replay, hide_host=True).median_s * 1e3
        row("moe_graph", name, tg, peer, tilehal.calc_diff(gout, ours(x)),
            "CUDA graph replay vs the transformers block eager; calc_diff vs our eager output")
        del graph
    except Exception as e:
        row("moe_graph", name, None, note=f"capture failed: {type(e).__name__}: {str(e)[:200]}")


def sec_host(env: Env) -> None:
    import deepgemm

    from tilestack.layers import GemmLinear

    m, n, k = env.s["gemm"]
    a = torch.randn(m, k, device=env.device).to(torch.bfloat16)
    w = torch.randn(n, k, device=env.device).to(torch.bfloat16)
    d = torch.empty(m, n, device=env.device, dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device=env.device, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        gl = GemmLinear.from_linear(lin)
        cases = (("cuBLAS F.linear", lambda: torch.nn.functional.linear(a, w)),
                 ("deepgemm.bf16_gemm_nt", lambda: deepgemm.bf16_gemm_nt(a, w, d)),
                 ("GemmLinear", lambda: gl(a)),
                 ("op tilestack::bf16_gemm_nt", lambda: torch.ops.tilestack.bf16_gemm_nt(a, w, torch.bfloat16)))
        peer_host = peer_gpu = None
        for name, fn in cases:
            r = env.bench(fn, hide_host=True)
            host_us = r.host_s * 1e6 if r.host_s else None
            peer_host = host_us if peer_host is None else peer_host
            peer_gpu = r.median_s * 1e3 if peer_gpu is None else peer_gpu
            row("host", name, r.median_s * 1e3, peer_gpu, None,
                f"{m}x{n}x{k}; host {host_us:.1f} us/call vs cuBLAS {peer_host:.1f} us" if host_us and peer_host
                else f"{m}x{n}x{k}; host time not measured by this timer ({r.timer})",
                host_us=host_us, peer_host_us=peer_host)


def _top_kernels(fn, n: int = 12, reps: int = 3) -> list[dict]:
    """torch.profiler over `reps` calls of fn: the n kernels with the most GPU time (us per call)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        # Kernels carry self device time; the CPU ops that launched them only total device time.
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        if dev:
            out.append(dict(kernel=e.key[:110], calls=e.count // reps, us=dev / reps))
    out.sort(key=lambda r: -r["us"])
    return out[:n]


def sec_kernels(env: Env) -> None:
    """Where the GPU time goes: the top kernels of each prefill and MoE variant (torch.profiler)."""
    if not env.cuda:
        row("kernels", "-", None, note="skipped: needs a GPU")
        return
    if "prefill" in env.kernels_of:
        b, s = env.s["prefill"]
        base = _llama(env)
        ids = torch.randint(0, base.config.vocab_size, (b, s), device=env.device)
        with torch.no_grad():
            for name, m in _variants(env, base):
                if isinstance(m, Exception):
                    _failed("kernels", "prefill " + name, m)
                    continue
                top = _top_kernels(lambda m=m: m(ids), n=20)
                row("kernels", "prefill " + name, sum(k["us"] for k in top) / 1e3, None, None,
                    "top kernels (ms of GPU time per forward, the 20 largest)", top=top)
                for k in top:
                    print(f"    {k['us']:9.1f} us  x{k['calls']:<3d} {k['kernel']}", flush=True)
        del base
        _free()
    if "moe" not in env.kernels_of:
        return
    stack, x, _ = _moe_stack(env)
    with torch.no_grad():
        top = _top_kernels(lambda st=stack: st(x))
        row("kernels", "moe transformers", sum(k["us"] for k in top) / 1e3, None, None, "top kernels", top=top)
        for name, fp8 in (("moe ExpertParallelMoE bf16", False), ("moe ExpertParallelMoE fp8", True)):
            ours = copy.deepcopy(stack)
            register_optimizations(ours, backend=env.backend, fp8=fp8)
            top = _top_kernels(lambda ours=ours: ours(x))
            row("kernels", name, sum(k["us"] for k in top) / 1e3, None, None, "top kernels", top=top)
            del ours
            _free()
    del stack
    _free()


def sec_gemms(env: Env) -> None:
    """The prefill / decode GEMM shapes of the Llama model, one by one: deepgemm vs cuBLAS (GPU time)."""
    if not env.cuda:
        row("gemms", "-", None, note="skipped: needs a GPU")
        return
    import deepgemm

    c = env.s["llama"]
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    shapes = {"q/o_proj": (h, h), "k/v_proj": (kv, h), "gate/up_proj": (f, h), "down_proj": (h, f), "lm_head": (v, h)}
    for m in (env.s["prefill"][0] * env.s["prefill"][1], env.s["decode"][0]):
        for what, (n, k) in shapes.items():
            a = torch.randn(m, k, device="cuda").bfloat16()
            w = torch.randn(n, k, device="cuda").bfloat16()
            d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            peer = env.bench(lambda a=a, w=w: torch.nn.functional.linear(a, w), hide_host=True).median_s * 1e3
            t = env.bench(lambda a=a, w=w, d=d: deepgemm.bf16_gemm_nt(a, w, d), hide_host=True).median_s * 1e3
            tf = 2 * m * n * k / 1e9
            row("gemms", f"bf16 M={m} {what}", t, peer, None, f"{n}x{k}: {tf / t:.0f} vs cuBLAS {tf / peer:.0f} TFLOP/s")
            a8 = deepgemm.per_token_cast_to_fp8(a, tma_aligned_sf=True)
            w8 = deepgemm.per_block_cast_to_fp8(w)
            t8 = env.bench(lambda a8=a8, w8=w8, d=d: deepgemm.fp8_gemm_nt(a8, w8, d), hide_host=True).median_s * 1e3
            tc = env.bench(lambda a=a: deepgemm.per_token_cast_to_fp8(a, tma_aligned_sf=True),
                           hide_host=True).median_s * 1e3
            row("gemms", f"fp8 M={m} {what}", t8, peer, None,
                f"{tf / t8:.0f} TFLOP/s vs bf16 cuBLAS; + activation cast {tc * 1e3:.1f} us")
            del a, w, d, a8, w8
        _free()


def sec_profile(env: Env) -> None:
    """tilestack.profile of the prefill model (bf16 swaps considered), the report next to --json."""
    from tilestack import profile

    b, s = env.s["prefill"]
    base = _llama(env)
    ids = torch.randint(0, base.config.vocab_size, (b, s), device=env.device)
    out = Path(env.out_dir) / ("profile_quick.md" if env.quick else "profile_llama3_8b_2l_prefill.md")
    rep = profile(base, (ids,), out=out, iters=3)
    saved = sum(x.before_ms - x.after_ms for x in rep.swaps)
    row("profile", "plain", rep.total_ms, None, None,
        f"report {out.name}; {len(rep.swaps)} swaps timed, {saved:+.3f} ms saved per forward; "
        f"{sum(1 for g in rep.gemms if g.autotune)} GEMM shapes flagged for autotuning")
    del base
    _free()


def dense_kernel_key(kind: str, m: int, n: int, k: int, num_sms: int = 132):
    """The kernel deepgemm's dense path launches for a bias-free [m, k] x [n, k]^T GEMM with a bf16 D (as
    cuda_gemm.dense picks it: the split-K / tile kernel where pick_splitk takes the shape, else the persistent
    kernel), and the function that compiles it."""
    from deepgemm import cuda_gemm, splitk
    from deepgemm.heuristics import pick_config, tile_rule

    sk = splitk.pick_splitk(m, n, k, num_sms, kind) if cuda_gemm.splitk_allowed() else None
    if sk is not None:
        return splitk.splitk_key(sk, n, k, torch.bfloat16, None, fp8=kind == "fp8"), splitk.compile_kernels
    d = torch.empty((0, n), dtype=torch.bfloat16)   # only its dtype matters to the epilogue choice
    cfg = pick_config(kind, m, n, k, num_sms=num_sms, **cuda_gemm.epilogue(d, n, False, "normal"),
                      max_multicast=cuda_gemm.max_multicast(), overlap=cuda_gemm.overlap_allowed())
    cfg = tile_rule(cfg, m, n, k)   # the dispatch's measured tile exceptions (a bias-free call, as cuda_gemm.dense)
    return cuda_gemm.kernel_key(cfg, n, k, "normal", 1, torch.bfloat16, False), lambda keys: cuda_gemm.compile_kernel(keys[0])


def _compile_one(args) -> float:
    kind, m, n, k = args
    t0 = time.perf_counter()
    key, build = dense_kernel_key(kind, m, n, k)
    build([key])
    return time.perf_counter() - t0


def _compile_grouped(args) -> float:
    """The contiguous grouped kernel ExpertParallelMoE's one-process path launches for M_sum = m (cuda_gemm's
    grouped_contiguous picks it the same way)."""
    from deepgemm import cuda_gemm
    from deepgemm.heuristics import pick_config

    kind, m, n, k, g = args
    t0 = time.perf_counter()
    d = torch.empty((m, n), dtype=torch.bfloat16)   # only its dtype and n matter to the epilogue choice
    cfg = pick_config(kind, m, n, k, num_groups=g, grouping="contiguous", num_sms=132,
                      **cuda_gemm.epilogue(d, n, False, "contiguous"), max_multicast=cuda_gemm.max_multicast(),
                      overlap=cuda_gemm.overlap_allowed())
    cuda_gemm.compile_kernel(cuda_gemm.kernel_key(cfg, n, k, "contiguous", g, torch.bfloat16, False))
    return time.perf_counter() - t0


def precompile(env: Env, workers: int = 12, sections: tuple = ("prefill", "decode")) -> None:
    """NVRTC-compile the dense kernels the Llama rows will ask for, in parallel processes (the compile
    cache is shared on disk): a fresh GPU machine otherwise compiles them one by one inside the timed
    sections' warm-up. The fused cast kernels compile in the same pool."""
    import concurrent.futures as cf
    import multiprocessing as mp

    c = env.s["llama"]
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    ms = [env.s["prefill"][0] * env.s["prefill"][1]] * ("prefill" in sections or "compile" in sections)
    ms += [env.s["decode"][0]] * ("decode" in sections)
    kinds = sorted({"fp8" if VARIANTS[v].get("fp8") else "bf16" for v in env.variants})
    jobs = [(kind, m, n, k) for kind in kinds for m in ms for n, k in ((h, h), (kv, h), (f, h), (h, f), (v, h))]
    if ("prefill" in sections or "decode" in sections) and any(VARIANTS[v].get("fuse_mlp") for v in env.variants):
        jobs += [(kind, m, 2 * f, h) for kind in kinds for m in ms]   # GemmSwiGLU's gate|up GEMM
    if ("prefill" in sections or "decode" in sections) and any(VARIANTS[v].get("fuse_qkv") for v in env.variants):
        jobs += [(kind, m, h + 2 * kv, h) for kind in kinds for m in ms]   # ProjectionGroup's q|k|v GEMM
    grouped = []
    if "moe" in sections:
        mc = env.s["moe"]
        h, f, e = mc["hidden_size"], mc["intermediate_size"], mc["num_local_experts"]
        pairs = env.s["moe_tokens"] * mc["num_experts_per_tok"]
        from tilestack.moe import local_layout_rows

        m_cap = local_layout_rows(pairs, e, 128)
        grouped = [(kind, m_cap, n, k, e) for kind in ("bf16", "fp8") for n, k in ((2 * f, h), (h, f))]
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(_compile_one, j) for j in jobs] + [pool.submit(_compile_grouped, j) for j in grouped]
        from deepgemm import cuda_cast

        bf16 = torch.bfloat16
        used = [cuda_cast.token_expression(bf16, 128, True), cuda_cast.block_expression(bf16, True),
                cuda_cast.silu_expression(bf16, False, True), cuda_cast.silu_expression(bf16, True, True)]
        futs += [pool.submit(cuda_cast.compile_module, (e,)) for e in used]
        from tilestack import norm

        h = env.s["llama"]["hidden_size"]
        chunks = -(-h // (norm.THREADS * norm.VEC))
        futs += [pool.submit(norm.compile_module, (norm.kernel_expression(chunks, h % norm.VEC == 0, f),))
                 for f in (False, True)[: 1 + (h % 128 == 0)]]
        for fu in futs:
            fu.result()
    print(f"# precompiled {len(jobs) + len(grouped)} GEMM kernels + the casts in {time.perf_counter() - t0:.1f} s", flush=True)


SECTIONS = {"gemms": sec_gemms, "kernels": sec_kernels, "host": sec_host, "prefill": sec_prefill, "decode": sec_decode, "moe": sec_moe, "profile": sec_profile,
            "compile": sec_compile}


def main(argv=None) -> int:
    args = _args(argv)
    env = Env(args)
    only = args.only.split(",") if args.only else [k for k in SECTIONS if k not in ("gemms", "kernels")]
    print(f"bench_models: device {env.device}, dtype {env.dtype}, budget {env.budget:.0f} s, sections {only}",
          flush=True)
    _SAVE.append(lambda: _write(args, env))
    if args.precompile and (env.cuda or args.warm_only):
        precompile(env, workers=args.workers, sections=tuple(only))
    if args.warm_only:
        return 0
    for name in only:
        if env.left() < 10:
            row(name, "-", None, note="skipped: time budget")
            continue
        t0 = time.perf_counter()
        try:
            SECTIONS[name](env)
        except Exception as e:
            traceback.print_exc()
            row(name, "-", None, note=f"section failed: {type(e).__name__}: {str(e)[:300]}")
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
        _free()
        _write(args, env)  # after every section: a run cut short keeps what it measured
    from tilestack.layers import bf16_choice_table, swiglu_choice_table

    choices = (
        ("bf16_choices", bf16_choice_table(), "GemmLinear's measured bf16 GEMM choice per shape (deepgemm vs cuBLAS)",
         lambda t: f"bf16 {t['m']:6d} x {t['n']:6d} x {t['k']:6d}{' +bias' if t['bias'] else ''}: deepgemm "
                   f"{t['deepgemm_us']:9.1f} us  cuBLAS {t['cublas_us']:9.1f} us"),
        ("swiglu_choices", swiglu_choice_table(), "GemmSwiGLU's measured path per shape (fused vs the three GEMMs)",
         lambda t: f"swiglu {t['m']:6d} x {t['hidden']} -> {t['ffn']}{' fp8' if t['fp8'] else ''}: fused "
                   f"{t['fused_us']:9.1f} us  three GEMMs {t['unfused_us']:9.1f} us"))
    for workload, table, note, line in choices:
        if table:
            row(workload, f"{len(table)} shapes", None, note=note + ", host time included", table=table)
            for t in table:
                print(f"    {line(t)}  -> {t['choice']}", flush=True)
    _write(args, env)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _write(args, env: Env) -> None:
    if not args.json:
        return
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=(torch.cuda.get_device_name() if env.cuda else platform.processor() or platform.machine()),
                torch=torch.__version__, transformers=transformers.__version__, quick=env.quick,
                wall_s=round(time.perf_counter() - T0, 1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(dict(meta=meta, rows=ROWS), indent=1))


if __name__ == "__main__":
    sys.exit(main())
