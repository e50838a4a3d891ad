"""Whole-model decode step of a Llama-3-8B-shaped transformers model: transformers' caches vs kvpool.

    python src/tilestack/hf/bench_hf_decode.py --device cuda --json docs/benchmarks/hf_decode.json

Model: Llama architecture, 4 layers, hidden 4096, GQA 32/8 heads, head_dim 128, MLP 14336, vocab
128256, random weights, bf16. Batch 8 at each context (32K and 128K by default): the caches are
filled with the same random K/V (no 128K prefill is run), then one decode step of the whole model
is timed (CUDA events, median) for

  hf_dynamic_eager   transformers' default: DynamicCache + SDPA
  hf_static_graph    transformers' StaticCache + SDPA, captured in a CUDA graph
  kv_dense_eager     tilestack.hf on kvpool, dense paged decode
  kv_sparse_eager    the same, sparse: Quest top-64 blocks per kv head (dataengine.select_blocks)
  kv_dense_graph     kvpool dense, the whole model step in a CUDA graph (static decode)
  kv_sparse_graph    kvpool sparse in a CUDA graph

plus time to first token (batch 1) of a request whose 32K prefix is cached vs cold, kvpool, and
transformers' cold prefill for reference. A column that cannot run (missing kernel, capture
failure, memory) is skipped with its reason; nothing asserts a time. `--quick` runs tiny shapes
(a CPU smoke test of the script).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
import traceback


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--contexts", default="32768,131072", help="comma-separated context lengths")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--top-k", type=int, default=64, help="sparse blocks per (sequence, kv head)")
    p.add_argument("--iters", type=int, default=10, help="timed steps per column (after 2 warm-up steps)")
    p.add_argument("--ttft-context", type=int, default=32768, help="cached prefix of the TTFT request (0: skip)")
    p.add_argument("--quick", action="store_true", help="tiny model and contexts (smoke test)")
    p.add_argument("--optimize", nargs="?", const="", default=None, metavar="FLAGS",
                   help="also run the kvpool columns (opt_kv_*) on a copy of the model after "
                   "tilestack.register_optimizations (the transformers columns stay on the unmodified one); FLAGS: "
                   "comma-separated register_optimizations switches to turn on as well, e.g. fuse_mlp,fuse_qkv")
    p.add_argument("--profile", metavar="DIR", help="also write, per eager kvpool column and context, a cProfile "
                   "(host time by function) and a torch.profiler table (syncs, copies, launches) of 3 steps into DIR")
    p.add_argument("--summary-dtype", choices=("bf16", "fp8", "int4"), default="bf16",
                   help="the pool's key summaries (SparseConfig.summary_dtype): what the sparse columns select from")
    return p.parse_args(argv)


class Timer:
    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def median(self, fn, iters: int, warmup: int = 2) -> float:
        """Median seconds of fn() over `iters` calls after `warmup`."""
        torch = self.torch
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(iters):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    def once(self, fn) -> float:
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t


def build_model(args, device, max_len):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.quick:
        shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                     vocab_size=1024)
    else:
        shape = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=128256)
    cfg = LlamaConfig(num_hidden_layers=4, max_position_embeddings=max_len, rope_parameters={
        "rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False, pad_token_id=None,
        bos_token_id=None, eos_token_id=None, **shape)
    cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    return model, cfg, dtype


def layer_kv(cfg, B, L, layer, dtype, device):
    """The random K/V of one layer, [B, L, kv_heads, head_dim] each (same for every cache)."""
    import torch

    g = torch.Generator(device=device).manual_seed(1000 + layer)
    shape = (B, L, cfg.num_key_value_heads, cfg.head_dim)
    return (torch.randn(shape, generator=g, device=device, dtype=dtype),
            torch.randn(shape, generator=g, device=device, dtype=dtype))


def profile_steps(fn, path: str, steps: int = 3) -> None:
    """cProfile (by own and cumulative time) and torch.profiler (CPU + CUDA, by CPU time) of `steps` calls of fn
    after a warm one, written to path + ".cprofile.txt" / ".torch.txt"."""
    import cProfile
    import io
    import os
    import pstats

    import torch

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
    with open(path + ".cprofile.txt", "w") as f:
        f.write(f"{steps} steps\n" + out.getvalue())
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as tp:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with open(path + ".torch.txt", "w") as f:
        f.write(f"{steps} steps\n" + tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=50,
                                                               max_name_column_width=90))


def skip(e: BaseException) -> dict:
    msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    print(f"    skipped: {msg}", flush=True)
    traceback.print_exc(limit=3, file=sys.stdout)
    return {"skipped": msg}


def free():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def graph_step(model, timer, prepare, x, pos, cache, iters):
    """Capture one decode step of the whole model; time prepare + replay and replay alone."""
    import torch

    import tilestack.hf as th

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(2):
            prepare()
            model(x, **th.cache_kwargs(model, cache), position_ids=pos)
            pos.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    prepare()
    with torch.cuda.graph(g), torch.no_grad():
        model(x, **th.cache_kwargs(model, cache), position_ids=pos)
    g.replay()  # capturing ran nothing: run the captured step once

    def step():
        prepare()
        pos.add_(1)
        g.replay()

    total = timer.median(step, iters)
    replay = timer.median(g.replay, iters)
    return {"ms": total * 1e3, "replay_ms": replay * 1e3}


SAFE = ("hf_dynamic_eager", "kv_dense_eager", "kv_sparse_eager", "kv_dense_graph")
# Captures that may fail (a host synchronization inside): run last, so a failed capture cannot spoil the rest.
RISKY = ("hf_static_graph", "kv_sparse_graph")


def run_context(args, model, cfg, dtype, device, L, timer, th, results, columns, kv_models=None):
    """The decode-step columns at context L; the kvpool ones once per (prefix, model) of kv_models (default: the
    model itself, no prefix)."""
    import torch
    from transformers import DynamicCache, StaticCache

    B, steps = args.batch, 4 * args.iters + 32
    res = results.setdefault(str(L), {})
    x = torch.randint(0, cfg.vocab_size, (B, 1), device=device)

    def pos_at(n):
        return torch.full((B, 1), n, device=device, dtype=torch.long)

    ref_logits = None
    # ---- transformers default: DynamicCache + SDPA, eager
    if "hf_dynamic_eager" in columns:
        print(f"  [{L}] hf_dynamic_eager", flush=True)
        try:
            dc = DynamicCache(config=cfg)
            for layer in range(cfg.num_hidden_layers):
                k, v = layer_kv(cfg, B, L, layer, dtype, device)
                dc.update(k.transpose(1, 2), v.transpose(1, 2), layer)
                del k, v
            with torch.no_grad():
                ref_logits = model(x, cache=dc, position_ids=pos_at(L)).logits[:, -1].float()
            n = [L + 1]

            def hf_step():
                with torch.no_grad():
                    model(x, cache=dc, position_ids=pos_at(n[0]))
                n[0] += 1

            res["hf_dynamic_eager"] = {"ms": timer.median(hf_step, args.iters) * 1e3}
            dc = None  # noqa: F841 - frees the cache
        except Exception as e:  # noqa: BLE001 - a column is skipped with its reason
            res["hf_dynamic_eager"] = skip(e)
        free()
    # ---- transformers StaticCache + SDPA, CUDA graph
    if "hf_static_graph" not in columns:
        pass
    elif device.type != "cuda":
        res["hf_static_graph"] = {"skipped": "CUDA graphs need a CUDA device"}
    else:
        print(f"  [{L}] hf_static_graph", flush=True)
        try:
            sc = StaticCache(config=cfg, max_cache_len=L + steps)
            for layer in range(cfg.num_hidden_layers):
                k, v = layer_kv(cfg, B, L, layer, dtype, device)
                sc.update(k.transpose(1, 2), v.transpose(1, 2), layer)
                del k, v
            pos = pos_at(L)
            res["hf_static_graph"] = graph_step(model, timer, lambda: None, x, pos, sc, args.iters)
            sc = None  # noqa: F841
        except Exception as e:  # noqa: BLE001
            res["hf_static_graph"] = skip(e)
        free()
    # ---- kvpool
    if not any(c.startswith("kv_") for c in columns):
        return
    for prefix, kv_model in kv_models or [("", model)]:
        kv_columns(args, kv_model, cfg, dtype, device, L, timer, th, res, columns, prefix, x, pos_at, ref_logits, steps)


def kv_columns(args, model, cfg, dtype, device, L, timer, th, res, columns, prefix, x, pos_at, ref_logits, steps):
    import torch

    B = args.batch
    bs = 16
    sdt = {"bf16": None, "fp8": torch.float8_e4m3fn, "int4": "int4"}[args.summary_dtype]
    sparse_cfg = th.SparseConfig(top_k=args.top_k, summary_dtype=sdt)
    cache = th.enable_kvpool(model, num_blocks=B * (-(-(L + steps) // bs) + 1), block_size=bs, sparse=sparse_cfg)
    cache.sparse = None
    try:
        pool = cache.pool
        sids = [("bench", L, b) for b in range(B)]
        slots = []
        for sid in sids:
            pool.add_sequence(sid, [])
            slots.append(pool.append(sid, L).to(device))
        for layer in range(cfg.num_hidden_layers):
            k, v = layer_kv(cfg, B, L, layer, dtype, device)
            for b in range(B):
                pool.write(layer, slots[b], k[b], v[b])
            del k, v
        cache.attach(sids)
        with torch.no_grad():
            logits = model(x, **th.cache_kwargs(model, cache), position_ids=pos_at(L)).logits[:, -1].float()
        if ref_logits is not None:
            d = (logits - ref_logits).abs().max().item()
            res[prefix + "kv_dense_vs_hf_max_abs_logit_diff"] = d
            res["logit_scale_max_abs"] = ref_logits.abs().max().item()
            print(f"    first step logits: {prefix}kvpool dense vs transformers max |diff| {d:.4g} "
                  f"(max |logit| {res['logit_scale_max_abs']:.3g})", flush=True)
        for name, sparse in (("kv_dense_eager", None), ("kv_sparse_eager", sparse_cfg)):
            if name not in columns:
                continue
            print(f"  [{L}] {prefix}{name}", flush=True)
            cache.sparse = sparse
            n = [L + 1]

            def kv_step(n=n):
                with torch.no_grad():
                    model(x, **th.cache_kwargs(model, cache), position_ids=pos_at(n[0]))
                n[0] += 1

            try:
                res[prefix + name] = {"ms": timer.median(kv_step, args.iters) * 1e3}
                if args.profile and device.type == "cuda":
                    profile_steps(kv_step, f"{args.profile}/{prefix}{name}_{L}")
            except Exception as e:  # noqa: BLE001
                res[prefix + name] = skip(e)
        for name, sparse in (("kv_dense_graph", None), ("kv_sparse_graph", sparse_cfg)):
            if name not in columns:
                continue
            print(f"  [{L}] {prefix}{name}", flush=True)
            if device.type != "cuda":
                res[prefix + name] = {"skipped": "CUDA graphs need a CUDA device"}
                continue
            cache.sparse = sparse
            try:
                n0 = pool.num_tokens(sids[0])
                cache.begin_static_decode(max_blocks=-(-(L + steps) // bs) + 1)
                res[prefix + name] = graph_step(model, timer, cache.prepare_static_step, x, pos_at(n0), cache,
                                                args.iters)
            except Exception as e:  # noqa: BLE001
                res[prefix + name] = skip(e)
            finally:
                cache.end_static_decode()
                torch.cuda.synchronize()
    finally:
        cache.release()
        th.disable_kvpool(model)
        cache = None  # noqa: F841
        free()


def add_speedups(res):
    base = res.get("hf_dynamic_eager", {}).get("ms")
    for name in [n for n in res if n != "hf_dynamic_eager" and isinstance(res[n], dict)]:
        if base and "ms" in res.get(name, {}):
            res[name]["speedup_vs_hf_dynamic_eager"] = base / res[name]["ms"]


def run_ttft(args, model, cfg, device, timer, th, out):
    import torch

    P = args.ttft_context
    suffix = 64
    g = torch.Generator().manual_seed(7)

    def prompt(prefix=None):
        p = torch.randint(0, cfg.vocab_size, (1, P + suffix), generator=g)
        if prefix is not None:
            p[:, :P] = prefix[:, :P]
        return p.to(device)

    print(f"  [ttft {P}] transformers cold prefill", flush=True)
    try:
        warm = prompt()[:, :1024]
        with torch.no_grad():
            model(warm, use_cache=True)
        p = prompt()
        with torch.no_grad():
            out["hf_cold_ms"] = timer.once(lambda: model(p, use_cache=True, logits_to_keep=1)) * 1e3
    except Exception as e:  # noqa: BLE001
        out["hf_cold"] = skip(e)
    free()
    cache = th.enable_kvpool(model, num_blocks=6 * (-(-(P + suffix) // 16)) + 16, block_size=16)
    try:
        def request(ids):
            start = cache.new_request(ids)
            with torch.no_grad():
                model(ids[:, start:], **th.cache_kwargs(model, cache), logits_to_keep=1)
            return start

        request(prompt()[:, :1024])  # warm-up (kernels, allocator)
        cold, cached = [], []
        for _ in range(2):
            first = prompt()
            print(f"  [ttft {P}] kvpool cold", flush=True)
            cold.append(timer.once(lambda first=first: request(first)))
            second = prompt(first)
            print(f"  [ttft {P}] kvpool prefix cached", flush=True)
            hit = []
            cached.append(timer.once(lambda second=second, hit=hit: hit.append(request(second))))
        out.update({"kv_cold_ms": min(cold) * 1e3, "kv_cached_ms": min(cached) * 1e3, "cached_tokens": hit[0],
                    "speedup_cached_vs_cold": min(cold) / min(cached)})
    except Exception as e:  # noqa: BLE001
        out["kv"] = skip(e)
    finally:
        cache.release()
        th.disable_kvpool(model)
        cache = None  # noqa: F841
        free()


def main(argv=None) -> int:
    args = _args(argv)
    import torch

    try:
        import transformers

        import tilestack.hf as th
    except ImportError as e:
        print(f"bench_hf_decode: {e}")
        return 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_hf_decode: no CUDA device")
        return 1
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if args.quick:
        contexts, args.iters, args.ttft_context = [64, 160], min(args.iters, 2), min(args.ttft_context, 128)
    timer = Timer(device)
    t0 = time.perf_counter()
    model, cfg, dtype = build_model(args, device, max(contexts + [args.ttft_context]) + 4096)
    print(f"model built in {time.perf_counter() - t0:.1f} s", flush=True)
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "batch": args.batch,
        "top_k_blocks": args.top_k, "summary_dtype": args.summary_dtype, "block_size": 16,
        "dtype": str(dtype).replace("torch.", ""),
        "model": {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")},
        "decode_step": {}, "ttft": {},
    }
    kv_models = [("", model)]
    if args.optimize is not None:
        import copy

        from tilestack import register_optimizations

        flags = {f: True for f in args.optimize.split(",") if f}
        bad = sorted(set(flags) - {"fuse_mlp", "fuse_qkv", "fuse_norm", "fuse_rope", "fp8"})
        if bad:
            print(f"bench_hf_decode: --optimize: unknown switches {bad} (expected fuse_mlp, fuse_qkv, fuse_norm, "
                  "fuse_rope, fp8)")
            return 2
        opt = copy.deepcopy(model)
        rep = register_optimizations(opt, backend="cuda" if device.type == "cuda" else "cpu", **flags)
        report["optimize"] = {"flags": sorted(flags), "swapped": len(rep.swapped)}
        print(f"opt_* columns: {len(rep.swapped)} modules swapped by register_optimizations", flush=True)
        kv_models.append(("opt_", opt))
    for L in contexts:
        run_context(args, model, cfg, dtype, device, L, timer, th, report["decode_step"], SAFE, kv_models)
    if args.ttft_context:
        run_ttft(args, model, cfg, device, timer, th, report["ttft"])
    for L in contexts:
        run_context(args, model, cfg, dtype, device, L, timer, th, report["decode_step"], RISKY, kv_models)
    for res in report["decode_step"].values():
        add_speedups(res)
    cols = tuple(p + c for c in ("hf_dynamic_eager", "hf_static_graph", "kv_dense_eager", "kv_sparse_eager",
                                 "kv_dense_graph", "kv_sparse_graph") for p in ("", "opt_")
                 if (p + c) in {k for r in report["decode_step"].values() for k in r})
    print(f"\ndecode step, ms (batch {args.batch}; speedup vs hf_dynamic_eager)")
    print("context  " + "  ".join(f"{c:>18}" for c in cols))
    for L, res in report["decode_step"].items():
        cells = []
        for c in cols:
            r = res.get(c, {})
            if "ms" in r:
                sp = r.get("speedup_vs_hf_dynamic_eager")
                cells.append(f"{r['ms']:9.3f}" + (f" ({sp:5.1f}x)" if sp else "        "))
            else:
                cells.append(f"{'skipped':>18}")
        print(f"{L:>7}  " + "  ".join(f"{c:>18}" for c in cells))
    if report["ttft"]:
        print(f"ttft: {json.dumps(report['ttft'])}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
