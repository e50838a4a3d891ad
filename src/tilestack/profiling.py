"""`tilestack.profile(model, inputs, out=PATH)` (this module: `tilestack.profiling`): where a model's time goes, and what the stack would change.

1. The model runs under `torch.profiler` with every module's forward labelled (`module::<name>`),
   so time is attributed to modules (inclusive wall time of their forward) and to operators and
   kernels (self time, CPU and, on CUDA, device).
2. GEMMs (`aten::mm/addmm/bmm/linear/matmul` and the `tilestack::` GEMM ops) are listed by shape
   (M, N, K), with their share of the GEMM time; a shape is flagged as worth autotuning where it
   takes >= 5% of the GEMM time and deepgemm's heuristic leaves its last wave of tiles under 75%
   full (`deepgemm.pick_config`'s `last_wave_util` of `num_sms`), i.e. where another tile shape
   may win.
3. `register_optimizations` runs on a deep copy of the model; each swapped module is timed
   against the original on the inputs it received in the profiled run (eager, host included,
   `tilehal.bench(hide_host=False)`), so the report says what each swap saves or costs here.
4. A markdown report (`out`) with the tables and, when matplotlib is installed, a plot
   (`<out stem>.png`); without matplotlib the report says the plot was skipped.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tilehal import ArgumentError

log = logging.getLogger("tilestack.profile")

_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "tilestack::bf16_gemm_nt",
             "tilestack::fp8_gemm_nt", "tilestack::gemm_linear")
AUTOTUNE_SHARE = 0.05
AUTOTUNE_WAVE_UTIL = 0.75


@dataclass
class ModuleTime:
    name: str
    type: str
    calls: int
    total_ms: float        # inclusive, per profiled iteration


@dataclass
class GemmShape:
    op: str
    m: int
    n: int
    k: int
    calls: int
    total_ms: float
    share: float
    autotune: str | None   # why it is worth autotuning, or None


@dataclass
class SwapTiming:
    name: str
    kind: str
    replacement: str
    before_ms: float
    after_ms: float
    max_rel_diff: float

    @property
    def speedup(self) -> float:
        return self.before_ms / self.after_ms if self.after_ms > 0 else float("inf")


@dataclass
class ProfileReport:
    device: str
    iters: int
    total_ms: float
    modules: list[ModuleTime] = field(default_factory=list)
    ops: list[tuple[str, int, float, float]] = field(default_factory=list)  # name, calls, cpu ms, device ms
    gemms: list[GemmShape] = field(default_factory=list)
    swaps: list[SwapTiming] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    optimization: str = ""
    plot: str | None = None
    plot_note: str = ""
    markdown: str = ""
    path: str | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(model: torch.nn.Module, inputs: Sequence[Any]) -> torch.device:
    for x in inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _label_modules(model: torch.nn.Module) -> list[Any]:
    """Forward hooks opening a record_function('module::<name>') range around each module."""
    handles = []
    for name, mod in model.named_modules():
        label = f"module::{name or '<root>'}"

        def pre(m, args, label=label):
            rf = torch.profiler.record_function(label)
            rf.__enter__()
            m.__dict__.setdefault("_tilestack_rf", []).append(rf)

        def post(m, args, out):
            m.__dict__["_tilestack_rf"].pop().__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    return handles


def _time(fn, device: torch.device, iters: int) -> float:
    import tilehal

    r = tilehal.bench(fn, warmup=2, iters=iters, device="cuda" if device.type == "cuda" else "cpu",
                      hide_host=False)
    return r.median_s * 1e3


def _rel_diff(a: Any, b: Any) -> float:
    if isinstance(a, tuple):
        a = a[0]
    if isinstance(b, tuple):
        b = b[0]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return float("nan")
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _gemm_mnk(op: str, shapes: list) -> tuple[int, int, int] | None:
    try:
        if op in ("aten::mm", "tilestack::bf16_gemm_nt", "tilestack::fp8_gemm_nt"):
            (m, k), other = shapes[0], shapes[2 if op == "tilestack::fp8_gemm_nt" else 1]
            n = other[0] if op.startswith("tilestack") else other[1]
            return m, n, k
        if op == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
            return m, n, k
        if op in ("aten::bmm", "aten::baddbmm"):
            a, b = shapes[-2], shapes[-1]
            return a[0] * a[1], b[2], a[2]
        if op == "tilestack::gemm_linear":
            (m, k), (n, _) = shapes[0], shapes[1]
            return m, n, k
    except (IndexError, TypeError, ValueError):
        return None
    return None


def _autotune_reason(m: int, n: int, k: int, share: float, fp8: bool) -> str | None:
    if share < AUTOTUNE_SHARE:
        return None
    import deepgemm

    try:
        cfg = deepgemm.pick_config("fp8" if fp8 else "bf16", m, n, k)
    except Exception as e:   # a shape deepgemm does not take: say so, do not guess
        return f"{share:.0%} of GEMM time; deepgemm's heuristic has no config ({type(e).__name__}: {e})"
    util = cfg.last_wave_util / cfg.num_sms
    if util < AUTOTUNE_WAVE_UTIL:
        return (f"{share:.0%} of GEMM time; heuristic tile {cfg.block_m}x{cfg.block_n}x{cfg.block_k} leaves the "
                f"last of {cfg.num_waves} waves {util:.0%} full on {cfg.num_sms} SMs")
    return None


def profile(model: torch.nn.Module, inputs: Any, out: str | Path | None = None, *, iters: int = 5,
            backend: str | None = None, fp8: bool = False, include: Sequence[str] | None = None,
            optimize: bool = True, top: int = 15, plot: bool = True) -> ProfileReport:
    """Profile `model(*inputs)` and report where time goes and what `register_optimizations` would change.

    inputs: the tuple of forward arguments (a tensor alone is taken as `(tensor,)`). iters: profiled
    (and timed) iterations. backend / fp8 / include: passed to `register_optimizations` on a deep
    copy (backend defaults to "cuda" on an sm_90 GPU, else "cpu"); `optimize=False` skips that part.
    out: markdown path (None: no file; the text is in `.markdown`). The model is not modified.
    """
    from .optimize import _cuda_unavailable_reason, capture_first_inputs, register_optimizations

    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, tuple):
        raise ArgumentError(f"inputs: expected the tuple of forward arguments, got {type(inputs).__name__}")
    if not isinstance(iters, int) or iters < 1:
        raise ArgumentError(f"iters: expected a positive int, got {iters!r}")
    device = _device_of(model, inputs)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.no_grad():
        model(*inputs)                         # warm-up: JIT builds, caches
        _sync(device)
        handles = _label_modules(model)
        try:
            with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
                t0 = time.perf_counter()
                for _ in range(iters):
                    model(*inputs)
                _sync(device)
                total_ms = (time.perf_counter() - t0) * 1e3 / iters
        finally:
            for h in handles:
                h.remove()
    rep = ProfileReport(str(device), iters, total_ms)
    events = prof.key_averages()
    types = {name or "<root>": type(m).__name__ for name, m in model.named_modules()}

    def dev_us(e, self_only: bool = False) -> float:
        names = ("self_device_time_total", "self_cuda_time_total") if self_only else \
            ("device_time_total", "cuda_time_total")
        return float(next((v for v in (getattr(e, n, None) for n in names) if v), 0.0))

    for e in events:
        if e.key.startswith("module::"):
            name = e.key[len("module::"):]
            rep.modules.append(ModuleTime(name, types.get(name, "?"), e.count // iters,
                                          e.cpu_time_total / 1e3 / iters))
    rep.modules.sort(key=lambda m: -m.total_ms)
    # Self times, so an aten op and the kernel it launches are not counted twice.
    op_rows = [(e.key, e.count // iters, e.self_cpu_time_total / 1e3 / iters, dev_us(e, True) / 1e3 / iters)
               for e in events if not e.key.startswith("module::") and not e.key.startswith("ProfilerStep")]
    op_rows.sort(key=lambda r: -(r[3] if device.type == "cuda" else r[2]))
    rep.ops = op_rows[:top]

    shaped: dict[tuple, list[float]] = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in _GEMM_OPS:
            mnk = _gemm_mnk(e.key, list(e.input_shapes))
            if mnk is None:
                continue
            t = (dev_us(e) if device.type == "cuda" else e.cpu_time_total) / 1e3 / iters
            acc = shaped.setdefault((e.key, *mnk), [0, 0.0])
            acc[0] += e.count // iters
            acc[1] += t
    gemm_total = sum(v[1] for v in shaped.values()) or 1.0
    for (op, m, n, k), (calls, t) in sorted(shaped.items(), key=lambda kv: -kv[1][1]):
        share = t / gemm_total
        rep.gemms.append(GemmShape(op, m, n, k, calls, t, share, _autotune_reason(m, n, k, share, fp8)))

    if optimize:
        if backend is None:
            backend = "cuda" if device.type == "cuda" and _cuda_unavailable_reason() is None else "cpu"
        twin = copy.deepcopy(model)
        report = register_optimizations(twin, backend=backend, fp8=fp8, include=include)
        rep.optimization = str(report)
        rep.skipped = [(d.name, d.reason) for d in report.skipped]
        names = {d.name for d in report.swapped}
        captured = capture_first_inputs(model, lambda name, mod: name in names, inputs)
        originals = dict(model.named_modules())
        swapped = dict(twin.named_modules())
        with torch.no_grad():
            for d in report.swapped:
                if d.name not in captured:
                    log.debug("profile: %s did not run in the profiled forward; not timed", d.name)
                    continue
                args, kwargs = captured[d.name]
                old, new = originals[d.name], swapped[d.name]
                want, got = old(*args, **kwargs), new(*args, **kwargs)
                before = _time(lambda f=old, a=args, kw=kwargs: f(*a, **kw), device, max(iters, 5))
                after = _time(lambda f=new, a=args, kw=kwargs: f(*a, **kw), device, max(iters, 5))
                rep.swaps.append(SwapTiming(d.name, d.kind, d.replacement or "", before, after,
                                            _rel_diff(got, want)))
    if plot and out is not None:
        rep.plot, rep.plot_note = _plot(rep, Path(out))
    elif plot:
        rep.plot_note = "plot skipped: no output path"
    rep.markdown = _markdown(rep, fp8)
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rep.markdown)
        rep.path = str(path)
    return rep


def _leaf_modules(rep: ProfileReport, limit: int) -> list[ModuleTime]:
    names = [m.name for m in rep.modules]
    leaves = [m for m in rep.modules if not any(o != m.name and (m.name == "<root>" or o.startswith(m.name + "."))
                                               for o in names)]
    return leaves[:limit]


def _plot(rep: ProfileReport, out: Path) -> tuple[str | None, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "plot skipped: matplotlib is not installed (pip install 'tilestack[bench]')"
    leaves = _leaf_modules(rep, 12)
    fig, axes = plt.subplots(1, 2 if rep.swaps else 1, figsize=(12 if rep.swaps else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    ax.barh([m.name for m in leaves][::-1], [m.total_ms for m in leaves][::-1], color="#4c72b0")
    ax.set_xlabel("ms per forward (inclusive)")
    ax.set_title(f"leaf modules, {rep.device}")
    if rep.swaps:
        sw = sorted(sorted(rep.swaps, key=lambda s: -abs(s.before_ms - s.after_ms))[:16],
                    key=lambda s: s.before_ms - s.after_ms)
        ax = axes[0][1]
        ax.barh([s.name for s in sw], [s.before_ms - s.after_ms for s in sw],
                color=["#55a868" if s.before_ms >= s.after_ms else "#c44e52" for s in sw])
        ax.axvline(0, color="black", lw=0.8)
        ax.set_xlabel("ms saved per call by the swap (negative: costs)")
        ax.set_title("register_optimizations, measured here")
    fig.tight_layout()
    png = out.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return str(png), ""


def _markdown(rep: ProfileReport, fp8: bool) -> str:
    import datetime
    import platform

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    dev = rep.device
    if dev.startswith("cuda"):
        dev += f" ({torch.cuda.get_device_name()})"
    else:
        dev += f" ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    lines = [f"# tilestack profile ({when})", "",
             f"Device {dev}, torch {torch.__version__}; {rep.iters} profiled forwards, "
             f"{rep.total_ms:.3f} ms per forward (wall).", ""]
    lines += ["## Modules (inclusive forward time per call of the model)", "",
              "| module | type | calls | ms | share |", "| --- | --- | ---: | ---: | ---: |"]
    for m in rep.modules[:25]:
        lines.append(f"| `{m.name}` | {m.type} | {m.calls} | {m.total_ms:.3f} | {m.total_ms / rep.total_ms:.0%} |")
    lines += ["", "## Operators and kernels (self time per forward)", "",
              "| op / kernel | calls | cpu ms | device ms |", "| --- | ---: | ---: | ---: |"]
    for name, calls, cpu, devms in rep.ops:
        lines.append(f"| `{name[:90]}` | {calls} | {cpu:.3f} | {devms:.3f} |")
    lines += ["", "## GEMM shapes", "",
              f"Flagged where a shape takes >= {AUTOTUNE_SHARE:.0%} of GEMM time and deepgemm's "
              f"{'fp8' if fp8 else 'bf16'} heuristic fills its last wave of tiles < {AUTOTUNE_WAVE_UTIL:.0%}.", "",
              "| op | M | N | K | calls | ms | share | worth autotuning |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for g in rep.gemms:
        lines.append(f"| `{g.op}` | {g.m} | {g.n} | {g.k} | {g.calls} | {g.total_ms:.3f} | {g.share:.0%} | "
                     f"{g.autotune or 'no'} |")
    if rep.optimization:
        saved = sum(s.before_ms - s.after_ms for s in rep.swaps)
        lines += ["", "## What register_optimizations would do here", "", "```", rep.optimization, "```", "",
                  "Each swap timed on the inputs the module received (eager, host included, median):", "",
                  "| module | swap | before ms | after ms | speedup | rel. diff of output |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for s in sorted(rep.swaps, key=lambda s: s.after_ms - s.before_ms):
            lines.append(f"| `{s.name}` | {s.kind} -> {s.replacement} | {s.before_ms:.4f} | {s.after_ms:.4f} | "
                         f"{s.speedup:.2f}x | {s.max_rel_diff:.2e} |")
        verdict = "saves" if saved >= 0 else "costs"
        lines += ["", f"Sum over the swaps: {verdict} {abs(saved):.3f} ms per forward on this machine."]
        slower = [s.name for s in rep.swaps if s.after_ms > s.before_ms]
        if slower:
            lines.append(f"Slower after the swap ({len(slower)}): keep them out of `include=`: "
                         + ", ".join(f"`{n}`" for n in slower[:10]) + (" ..." if len(slower) > 10 else ""))
    lines += [""]
    if rep.plot:
        lines += [f"![profile]({Path(rep.plot).name})", ""]
    elif rep.plot_note:
        lines += [f"({rep.plot_note})", ""]
    return "\n".join(lines)



# ----------------------------------------------------------------------------- CLI: tilestack profile

# Models built from configs (random weights): name -> (transformers config class, keyword arguments).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("LlamaConfig", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256)),
    "mixtral-tiny": ("MixtralConfig", dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                           num_local_experts=4, num_experts_per_tok=2)),
    "llama3-8b-2l": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                         rope_theta=500000.0)),
    "mixtral-8x7b-2l": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                              num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                              num_local_experts=8, num_experts_per_tok=2)),
}


def build_model(spec: str, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """A transformers causal LM from a preset name or a config.json path, random weights (fixed seed)."""
    import json

    import transformers

    if spec in PRESETS:
        cls_name, kw = PRESETS[spec]
        cfg = getattr(transformers, cls_name)(**kw)
    elif Path(spec).is_file():
        data = json.loads(Path(spec).read_text())
        cfg = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    else:
        raise ArgumentError(f"--model: expected a preset ({', '.join(PRESETS)}) or a config.json path, got {spec!r}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="tilestack profile",
                                description="profile a transformers model built from a config and write a markdown "
                                            "report (modules, kernels, GEMM shapes, what register_optimizations "
                                            "would swap and what each swap measures here)")
    p.add_argument("--model", default="llama-tiny", help=f"preset ({', '.join(PRESETS)}) or a config.json path")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--fp8", action="store_true", help="consider fp8 swaps")
    p.add_argument("--include", action="append", help="module name / fnmatch pattern (repeatable)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default="tilestack-profile.md")
    args = p.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = build_model(args.model, dtype, device)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    rep = profile(model, (ids,), out=args.out, iters=args.iters, fp8=args.fp8, include=args.include)
    print(f"wrote {rep.path}" + (f" and {rep.plot}" if rep.plot else f" ({rep.plot_note})"))
    print(f"{rep.total_ms:.3f} ms per forward; {len(rep.swaps)} swaps timed, "
          f"{sum(s.before_ms - s.after_ms for s in rep.swaps):+.3f} ms saved per forward")
    return 0
