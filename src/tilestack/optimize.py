"""register_optimizations: swap a model's modules for the stack's, and say what was and was not swapped.

- `nn.Linear` -> `tilestack.layers.GemmLinear` (deepgemm bf16, or fp8 with `fp8=True`), or with
  `sparse_24=True` -> dataengine `SparseLinear.from_dense(..., "2:4")` (pruned: outputs change).
- MoE blocks `tilestack.moe.moe_block_parts` accepts -> `ExpertParallelMoE`: transformers 5 blocks
  (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; same routing, shared experts kept) always; other
  blocks (gate Linear + ModuleList of experts) only when `include` names them (their forward may
  differ: a tensor out, softmax top-k routing).

`precision="auto"` picks fp8 or bf16 per Linear from a calibration forward (measured output error
against a budget, measured speed here) and says why in the report.

A module whose shape does not qualify is kept; the reason is logged at DEBUG (`tilestack.optimize`)
and listed in the returned report, as is every module `include` names that is not swapped.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tilehal import ArgumentError, check_choice

from .layers import (
    PROJECTION_GROUPS,
    GemmLinear,
    GemmSwiGLU,
    ProjectionGroup,
    projection_group_skip_reason,
    swiglu_skip_reason,
)
from .moe import ExpertParallelMoE, moe_block_parts
from .norm import FusedRMSNorm, rmsnorm_skip_reason
from .rope import fuse_rope_attention, rope_skip_reason

log = logging.getLogger("tilestack.optimize")

BACKENDS = ("cuda", "cpu")
_LINEAR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Decision:
    name: str
    kind: str              # "linear", "mlp", "norm", "attention", "moe" or "module" (named by include, neither)
    replacement: str | None  # class name when swapped
    reason: str            # why skipped, or how the replacement runs


@dataclass
class OptimizationReport:
    backend: str
    fp8: bool
    sparse_24: bool
    precision: str | None = None
    swapped: list[Decision] = field(default_factory=list)
    skipped: list[Decision] = field(default_factory=list)

    def names(self, which: str = "swapped") -> list[str]:
        return [d.name for d in getattr(self, which)]

    def __str__(self) -> str:
        prec = f", precision={self.precision!r}" if self.precision else ""
        lines = [f"register_optimizations(backend={self.backend!r}, fp8={self.fp8}, sparse_24={self.sparse_24}{prec}): "
                 f"{len(self.swapped)} swapped, {len(self.skipped)} skipped"]
        lines += [f"  swapped {d.name or '<root>'} ({d.kind}) -> {d.replacement}"
                  + (f": {d.reason}" if d.reason else "") for d in self.swapped]
        lines += [f"  skipped {d.name or '<root>'} ({d.kind}): {d.reason}" for d in self.skipped]
        return "\n".join(lines)


def _cuda_unavailable_reason() -> str | None:
    """Why deepgemm's CUDA kernels cannot run here, or None."""
    if not torch.cuda.is_available():
        import tilehal

        return tilehal.cuda_unavailable_reason() or "torch.cuda.is_available() is False"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"deepgemm's kernels need an sm_90 (Hopper) GPU, found compute capability {major}.{minor}"
    return None


def linear_skip_reason(linear: torch.nn.Module, backend: str, fp8: bool = False, sparse_24: bool = False
                       ) -> str | None:
    """Why `linear` cannot be swapped under these options, or None when it qualifies."""
    if type(linear) is not torch.nn.Linear:
        return (f"{type(linear).__name__} subclasses nn.Linear; its owner may read the weight directly and "
                "bypass forward, so it is kept")
    w = linear.weight
    k = linear.in_features
    if w.dtype not in _LINEAR_DTYPES:
        return f"weight dtype {w.dtype} is not one of float32/bfloat16/float16"
    if w.device.type == "meta":
        return "weight is on the meta device (materialize the model first)"
    if sparse_24:
        return None if k % 4 == 0 else f"2:4 sparsity needs in_features % 4 == 0, got {k}"
    if fp8 and k % 128:
        return f"fp8 needs in_features % 128 == 0 (1x128 activation / 128x128 weight scale blocks), got {k}"
    if backend == "cuda" and k % 8:
        return f"the CUDA bf16 GEMM needs in_features % 8 == 0 (TMA rows of 16 bytes), got {k}"
    return None


def moe_skip_reason(parts: Any, backend: str, fp8: bool) -> str | None:
    """Why ExpertParallelMoE cannot run this block under these options, or None."""
    e, h = parts.router.shape
    f = parts.gate.shape[1]
    if parts.gate.device.type == "meta":
        return "expert weights are on the meta device (materialize the model first)"
    if fp8 and (h % 128 or f % 128):
        return f"fp8 grouped GEMMs need hidden and ffn_hidden % 128 == 0, got {h} and {f}"
    if backend == "cuda" and (h % 8 or f % 8):
        return f"the CUDA grouped GEMMs need hidden and ffn_hidden % 8 == 0 (TMA rows of 16 bytes), got {h} and {f}"
    return None


# precision="auto": fp8 is taken where a layer's output error stays within this (normwise relative).
# Twice the RMS error of two e4m3 quantizations (unit 2^-4, uniform: 2^-4/sqrt(3) each) is 0.10; the
# default asks for a bit better than that so layers with outliers (per-block scales stretched) stay bf16.
FP8_ERROR_BUDGET = 0.08


def capture_first_inputs(model: torch.nn.Module, wanted: Callable[[str, torch.nn.Module], bool], inputs: tuple,
                         accept: Callable[[tuple, dict], bool] = lambda args, kwargs: True) -> dict[str, tuple]:
    """(args, kwargs) of the first call of each wanted submodule (wanted(name, module)) that `accept`
    takes, in one forward model(*inputs) under no_grad; the hooks are removed after, even on error."""
    captured: dict[str, tuple] = {}
    hooks = []
    for name, mod in model.named_modules():
        if wanted(name, mod):
            def hook(m, args, kwargs, name=name):
                if name not in captured and accept(args, kwargs):
                    captured[name] = (args, kwargs)
            hooks.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return captured


def _capture_linear_inputs(model: torch.nn.Module, include: Sequence[str] | None, calibration: tuple
                           ) -> dict[str, torch.Tensor]:
    """The first input each candidate nn.Linear receives in one forward on `calibration`."""
    seen = capture_first_inputs(model, lambda name, mod: type(mod) is torch.nn.Linear and _matches(name, include),
                                calibration, lambda args, kwargs: bool(args) and isinstance(args[0], torch.Tensor))
    return {name: args[0].detach() for name, (args, _) in seen.items()}


def _auto_precision(name: str, linear: torch.nn.Linear, x: torch.Tensor | None, backend: str, budget: float,
                    iters: int) -> tuple[torch.nn.Module, str]:
    """(GemmLinear in the chosen precision, why) from the measured error and speed of fp8 vs bf16."""
    import tilehal

    bf16 = GemmLinear.from_linear(linear, fp8=False)
    why_not = linear_skip_reason(linear, backend, fp8=True)
    if why_not is not None:
        return bf16, f"bf16 (fp8 not possible: {why_not})"
    if x is None:
        return bf16, "bf16 (not reached by the calibration forward: nothing measured)"
    fp8 = GemmLinear.from_linear(linear, fp8=True)
    dev = "cuda" if x.is_cuda else "cpu"
    with torch.no_grad():
        ref = linear(x).double()
        err = {}
        for label, mod in (("bf16", bf16), ("fp8", fp8)):
            err[label] = float((mod(x).double() - ref).norm() / ref.norm().clamp_min(1e-30))
        ms = {label: tilehal.bench(lambda m=mod: m(x), warmup=2, iters=iters, device=dev,
                                   hide_host=False).median_s * 1e3
              for label, mod in (("bf16", bf16), ("fp8", fp8))}
    facts = (f"error fp8 {err['fp8']:.3g} / bf16 {err['bf16']:.3g} (budget {budget:g}), "
             f"time fp8 {ms['fp8']:.4f} / bf16 {ms['bf16']:.4f} ms")
    log.debug("%s: %s", name, facts)
    if err["fp8"] > budget:
        return bf16, f"bf16: fp8 over the error budget; {facts}"
    if ms["fp8"] >= ms["bf16"]:
        return bf16, f"bf16: fp8 not faster here; {facts}"
    return fp8, f"fp8 e4m3: within budget and faster; {facts}"


# A bf16 model's output embedding (lm_head) takes cuBLAS from this M on, whatever its stand-alone per-shape
# measurement says. Measured in the model (Llama-3-8B shape, H200, session 28, docs/benchmarks/
# gpu_runs_2026-12-02_s28/): prefill 8 x 512 (M = 4096) 1.3-2.7 % faster with cuBLAS there (two runs of five
# interleaved rounds) although deepgemm measured 15 % faster alone; decode b64 (M = 64) 1.5 % (graph) - 5 %
# (eager) faster with deepgemm's head. Between 64 and 4096 it is not measured: 1024 splits decode batches from
# prefill chunks.
HEAD_CUBLAS_MIN_M = 1024
_HEAD_REASON = (f"output embedding (lm_head): bf16 per-shape choice below M = {HEAD_CUBLAS_MIN_M}, cuBLAS from "
                "there on (measured faster in the model at prefill)")

_BF16_REASON = ("bf16: deepgemm or cuBLAS per (M, N, K), whichever measured faster on this GPU "
                "(tilestack.layers.bf16_gemm_choice; CPU tensors: deepgemm's reference)")


def _matches(name: str, include: Sequence[str] | None) -> bool:
    return include is None or any(fnmatch.fnmatchcase(name, pat) for pat in include)


def register_optimizations(model: torch.nn.Module, backend: str = "cuda", fp8: bool = False, sparse_24: bool = False,
                           include: Sequence[str] | None = None, *, moe_group: Any = None,
                           sparse_method: str = "magnitude", precision: str | None = None,
                           calibration: Any = None, error_budget: float = FP8_ERROR_BUDGET,
                           timing_iters: int = 10, fuse_mlp: bool = False, fuse_norm: bool | None = None,
                           fuse_qkv: bool = False, fuse_rope: bool | None = None) -> OptimizationReport:
    """Swap `model`'s qualifying modules in place for TileStack's; returns what was swapped and skipped.

    backend: "cuda" (deepgemm's sm_90a kernels; shape rules of TMA apply; needs a Hopper GPU) or
      "cpu" (deepgemm's reference; any shape). The swapped layers run wherever their tensors are.
    fp8: GemmLinear with fp8 e4m3 operands (needs in_features % 128 == 0).
    sparse_24: prune Linears 2:4 by `sparse_method` into dataengine SparseLinear (exclusive with fp8).
    include: module names or fnmatch patterns to consider (None: every Linear and transformers MoE
      block; a bf16 CUDA model's output embedding then takes cuBLAS from M = HEAD_CUBLAS_MIN_M on, as measured
      in the model). Other MoE blocks are swapped for ExpertParallelMoE (on `moe_group`) only when named.
    precision: None (bf16, or fp8 with `fp8=True`), "bf16", "fp8", or "auto": run `calibration` (the
      tuple of forward arguments) once, and per Linear pick fp8 where its output's normwise relative
      error against the original is <= `error_budget` and it is faster than bf16 here (median of
      `timing_iters` eager calls on the input it received), else bf16; the reason is in the report.
    fuse_mlp: with backend="cuda", transformers' dense gated SiLU MLPs (Llama, Mistral, Qwen2/3) become
      GemmSwiGLU (gate and up as one GEMM, silu * up in one kernel; per M bucket that path or the original
      three GEMMs, whichever measured faster; not with sparse_24 or precision="auto"). Off by default: its
      per-M choice has not run on a GPU yet (the fused path alone passed there, 2026-12-02).
    fuse_norm: transformers' RMSNorm modules (tilestack.norm.RMSNORM_CLASSES) become FusedRMSNorm (the same
      formula in one kernel on CUDA bf16; the torch formula elsewhere and under torch.compile; with fp8 the
      kernel also casts its output for the fp8 GEMMs reading it). None (default): on with backend="cuda".
    fuse_qkv: sibling projections that read the same input (an attention block's q_proj / k_proj / v_proj,
      all swapped for GemmLinears of one precision) become a tilestack.layers.ProjectionGroup: one GEMM on
      their concatenated weight per forward (fp8: one activation cast), each projection returning its slice.
    fuse_rope: transformers' Llama / Mistral / Qwen2 attention blocks (tilestack.rope.ROPE_ATTENTION_CLASSES)
      rotate q and k in place by one kernel (CUDA bf16, bit for bit the torch ops; the torch formula elsewhere and
      under torch.compile): the block becomes its FusedRoPE subclass in place, children and state_dict unchanged.
      None (default): on with backend="cuda".
    """
    if not isinstance(model, torch.nn.Module):
        raise ArgumentError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_choice(precision, "precision", (None, "bf16", "fp8", "auto"))
    check_choice(backend, "backend", tuple(BACKENDS))
    fp8, sparse_24 = check_choice(fp8, "fp8", (False, True)), check_choice(sparse_24, "sparse_24", (False, True))
    if include is not None and (isinstance(include, (str, bytes)) or not isinstance(include, (list, tuple, set))
                                or not all(isinstance(p, str) for p in include)):
        raise ArgumentError(f"include: expected a sequence of names or patterns or None, got {include!r}")
    if precision == "fp8":
        fp8 = True
    if precision == "auto":
        if fp8:
            raise ArgumentError("precision='auto' and fp8=True: expected at most one of them, got both")
        if sparse_24:
            raise ArgumentError("precision='auto' and sparse_24: expected at most one of them, got both")
        if isinstance(calibration, torch.Tensor):
            calibration = (calibration,)
        if not isinstance(calibration, tuple):
            raise ArgumentError(f"calibration: expected the tuple of forward arguments for precision='auto', got "
                            f"{type(calibration).__name__}")
        if not (isinstance(error_budget, float | int) and error_budget > 0):
            raise ArgumentError(f"error_budget: expected a positive number, got {error_budget!r}")
    if backend not in BACKENDS:
        raise ArgumentError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if fp8 and sparse_24:
        raise ArgumentError("fp8 and sparse_24: expected at most one of them, got both (SparseLinear has no fp8 path)")
    if isinstance(include, str):
        raise ArgumentError(f"include: expected a sequence of names or patterns, got the string {include!r}")
    if backend == "cuda":
        why = _cuda_unavailable_reason()
        if why is not None:
            from tilehal import DeviceError

            raise DeviceError(f"backend='cuda' is not usable here: {why} (use backend='cpu')")
    if fuse_norm is None:
        # On for CUDA (GPU tests passed on the H200 2026-12-02; prefill 8 x 512 went 0.956x -> 1.055x, decode b64
        # 0.953x -> 1.009x with it); off for backend="cpu", where it would only run the torch formula.
        fuse_norm = backend == "cuda"
    fuse_norm = check_choice(fuse_norm, "fuse_norm", (False, True))
    fuse_qkv = check_choice(fuse_qkv, "fuse_qkv", (False, True))
    if fuse_rope is None:
        # On for CUDA: H200, session 29 (docs/benchmarks/gpu_runs_2026-12-02_s29/r2): prefill 8 x 512 bf16 1.046x ->
        # 1.090x the plain model, fp8 (with fuse_mlp) 1.613x; decode b64 eager 1.053x -> 1.115x (with fuse_mlp).
        fuse_rope = backend == "cuda"
    fuse_rope = check_choice(fuse_rope, "fuse_rope", (False, True))
    report = OptimizationReport(backend, fp8, sparse_24, precision)
    head = None
    if callable(getattr(model, "get_output_embeddings", None)):
        try:
            head = model.get_output_embeddings()
        except NotImplementedError:  # transformers' base class, for models without an output embedding
            head = None
    head_rule = (backend == "cuda" and include is None and not fp8 and not sparse_24 and precision != "auto"
                 and isinstance(head, torch.nn.Linear))
    seen = _capture_linear_inputs(model, include, calibration) if precision == "auto" else {}
    replacements: dict[int, torch.nn.Module] = {}
    rope_blocks: list[tuple[str, torch.nn.Module]] = []   # rewritten in place after the loop (children swapped)
    done: list[str] = []   # prefixes of replaced subtrees: their children are gone

    def decide(name: str, kind: str, new: torch.nn.Module | None, reason: str, module: torch.nn.Module,
               consumed: Sequence[str] | None = None) -> None:
        if new is None:
            log.debug("%s (%s) kept: %s", name or "<root>", kind, reason)
            report.skipped.append(Decision(name, kind, None, reason))
            return
        report.swapped.append(Decision(name, kind, type(new).__name__, reason))
        replacements[id(module)] = new
        # A replaced subtree's children are gone, except those the replacement keeps (shared experts).
        done.extend([name] if consumed is None else [f"{name}.{c}" if name else c for c in consumed])

    for name, module in model.named_modules():
        if any(name == p or name.startswith(p + ".") for p in done):
            continue
        if not isinstance(module, torch.nn.Linear):
            if fuse_rope and _matches(name, include) and rope_skip_reason(module) is None:
                rope_blocks.append((name, module))
                continue
            if fuse_norm and _matches(name, include) and rmsnorm_skip_reason(module) is None:
                decide(name, "norm", FusedRMSNorm(module, emit_fp8=fp8), "one kernel (bf16 on CUDA; the torch "
                       "formula elsewhere and under torch.compile)" + ("; its output also cast per token to fp8 in "
                                                                       "that kernel for the fp8 GEMMs reading it"
                                                                       if fp8 else ""), module)
                continue
            if (fuse_mlp and backend == "cuda" and not sparse_24 and precision != "auto" and _matches(name, include)
                    and swiglu_skip_reason(module) is None):
                whys = [linear_skip_reason(getattr(module, p), backend, fp8) for p in ("gate_proj", "up_proj",
                                                                                       "down_proj")]
                if all(w is None for w in whys):
                    decide(name, "mlp", GemmSwiGLU(module, fp8=fp8),
                           f"gate|up as one {'fp8' if fp8 else 'bf16'} GEMM, silu(gate) * up in one kernel"
                           + (" cast to fp8 for down" if fp8 else "") + ", then down", module)
                    continue
            parts = moe_block_parts(module)
            named = include is not None and _matches(name, include)
            if isinstance(parts, str):
                if named:
                    has_linears = any(isinstance(m, torch.nn.Linear) for m in module.modules())
                    decide(name, "module", None, parts + ("; its Linears are considered one by one" if has_linears
                                                          else ""), module)
                continue
            if not parts.exact and not named:
                decide(name, "moe", None, "MoE block: name it in include= to swap it for ExpertParallelMoE "
                       "(its forward then returns a tensor and routes by softmax top-k)", module)
                continue
            if include is not None and not named:
                continue
            why = moe_skip_reason(parts, backend, fp8)
            if why is not None:
                decide(name, "moe", None, why, module)
                continue
            new = ExpertParallelMoE.from_module(module, group=moe_group, use_fp8=fp8)
            decide(name, "moe", new, f"{parts.kind}: {new.num_local_experts} of {new.num_experts} experts on this "
                   f"rank" + (", shared expert kept" if parts.shared_expert is not None else ""), module,
                   consumed=parts.consumed)
            continue
        if not _matches(name, include):
            continue
        why = linear_skip_reason(module, backend, fp8, sparse_24)
        if why is not None:
            decide(name, "linear", None, why, module)
            continue
        if sparse_24:
            from dataengine import SparseLinear

            sl = SparseLinear.from_dense(module, "2:4", sparse_method)
            decide(name, "linear", sl, f"path {sl.path}" + (f" ({sl.reason})" if sl.reason else ""), module)
        elif precision == "auto":
            new, why = _auto_precision(name, module, seen.get(name), backend, float(error_budget), timing_iters)
            decide(name, "linear", new, why, module)
        elif head_rule and module is head:
            new = GemmLinear.from_linear(module)
            new.cublas_from_m = HEAD_CUBLAS_MIN_M
            decide(name, "linear", new, _HEAD_REASON, module)
        else:
            decide(name, "linear", GemmLinear.from_linear(module, fp8=fp8), "fp8 e4m3" if fp8 else _BF16_REASON,
                   module)

    if id(model) in replacements:
        # The root cannot be replaced in place; the caller holds the reference.
        d = report.swapped.pop()
        del replacements[id(model)]
        decide("", d.kind, None, "the root module cannot be replaced in place: wrap it in a container", model)
    # Every parent edge, so a module shared by two parents is replaced in both.
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in replacements:
                setattr(parent, child_name, replacements[id(child)])
    for name, module in rope_blocks:
        base = type(module).__name__
        fuse_rope_attention(module)
        report.swapped.append(Decision(name, "attention", type(module).__name__,
                                       f"{base} with q and k rotated in place by one kernel (bf16 on CUDA; the torch "
                                       "formula elsewhere and under torch.compile)"))
    if fuse_qkv:
        _group_projections(model, include, report)
    return report


def _group_projections(model: torch.nn.Module, include: Sequence[str] | None, report: OptimizationReport) -> None:
    """ProjectionGroups over each module's sibling projections (PROJECTION_GROUPS) that were all swapped."""
    for name, parent in model.named_modules():
        if isinstance(parent, GemmSwiGLU):
            continue
        for names in PROJECTION_GROUPS:
            members = [parent._modules.get(n) for n in names]
            if any(m is None for m in members):
                continue
            label = f"{name}.{{{','.join(names)}}}" if name else "{" + ",".join(names) + "}"
            if not all(_matches(f"{name}.{n}" if name else n, include) for n in names):
                continue
            why = projection_group_skip_reason(members)
            if why is not None:
                log.debug("%s not grouped: %s", label, why)
                report.skipped.append(Decision(label, "qkv", None, why))
                continue
            ProjectionGroup(members)
            report.swapped.append(Decision(label, "qkv", "ProjectionGroup",
                                           f"one {'fp8' if members[0].fp8 else 'bf16'} GEMM on the concatenated "
                                           f"weight ({sum(m.out_features for m in members)} rows), each projection "
                                           "its slice"))
