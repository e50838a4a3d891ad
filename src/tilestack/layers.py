"""Drop-in torch layers that run on deepgemm.

`GemmLinear` replaces `nn.Linear` (same `weight [out, in]` / `bias [out]` parameters and
state_dict keys): bf16 operands through `deepgemm.bf16_gemm_nt` or cuBLAS, per shape whichever measured
faster on this GPU (`bf16_gemm_choice`: each new (M, N, K) is timed once, host time included; under
torch.compile the choice is made while tracing, and a cuBLAS shape is traced as a plain linear that
inductor treats as in the unmodified model; TILESTACK_BF16_GEMM=deepgemm|cublas forces one), or with `fp8=True` e4m3
operands through `deepgemm.fp8_gemm_nt` (activations cast per token and 128 channels, the
weight per 128x128 block, cached until the weight changes), or with `fp4=True` FP4 (e2m1) weights
with 1 x 32 power-of-two block scales (`deepgemm.cast_weights_to_fp4`, cached the same way) and bf16
activations (fp8 ones with `fp8=True` too): `deepgemm.bf16_fp4_gemm_nt` / `fp8_fp4_gemm_nt`, the
decode-shape (memory-bound) choice. deepgemm runs its sm_90a kernels
on CUDA tensors and its exact reference on CPU tensors. Accumulation is fp32; the bias is added
in fp32; the result comes back in the input's dtype. Inference only (no autograd graph).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import deepgemm
import torch
from tilehal import ArgumentError, ShapeError

from . import _args, norm, ops

log = logging.getLogger("tilestack.layers")


# ----------------------------------------------------------------------------- bf16: deepgemm or cuBLAS

# (M bucket, n, k, bias, device index) -> "deepgemm" | "cublas": which bf16 GEMM measured faster here.
BF16_CHOICES: dict[tuple, str] = {}
_BF16_TIMES: dict[tuple, tuple[float, float, int, str]] = {}  # key -> (deepgemm s, cuBLAS s, M, choice)


def bf16_policy() -> str:
    """TILESTACK_BF16_GEMM: "auto" (default: per shape, whichever measured faster), "deepgemm" or "cublas"."""
    v = os.environ.get("TILESTACK_BF16_GEMM", "auto")
    return v if v in ("auto", "deepgemm", "cublas") else "auto"


# deepgemm is taken only where it measured at least this much faster than cuBLAS: on the H200 (2026-12-02,
# two device rounds) the Llama-3-8B-shaped prefill ran 0.956x / 0.961x the unmodified model with down_proj and
# lm_head on deepgemm after they measured 2-3 % faster alone, so a small measured lead does not carry into the
# model. TILESTACK_BF16_MARGIN overrides it (a fraction, 0 = the faster one).
BF16_MARGIN = 0.05


def bf16_margin() -> float:
    v = os.environ.get("TILESTACK_BF16_MARGIN")
    if v is None:
        return BF16_MARGIN
    try:
        f = float(v)
    except ValueError:
        f = -1.0
    if not 0.0 <= f < 1.0:
        raise ArgumentError(f"TILESTACK_BF16_MARGIN: expected a fraction in [0, 1), got {v!r}")
    return f


def bf16_pick(t_deepgemm: float, t_cublas: float) -> str:
    """The choice for these measured times: deepgemm where it is at least bf16_margin() faster, else cuBLAS."""
    return "deepgemm" if t_deepgemm < t_cublas * (1.0 - bf16_margin()) else "cublas"


def _measure_bf16(m: int, n: int, k: int, bias: bool, device: int, weight: torch.Tensor | None = None) -> str:
    """Time deepgemm.bf16_gemm_nt and cuBLAS (torch.nn.functional.linear) on random [m, k] activations times
    `weight` (the layer's own [n, k] bf16 weight; random when None), host time included (an eager call pays both),
    median of 10 calls each; record and return deepgemm where it was at least bf16_margin() faster, else cuBLAS.

    Why the layer's weight: a GEMM's speed depended on its operands. On the H200 (session 29,
    docs/benchmarks/gpu_runs_2026-12-02_s29/r5) cuBLAS's lm_head GEMM 4096 x 128256 x 4096 took 6.49 ms here on N(0, 1)
    weights but 4.97 ms inside the model (std 0.02 weights), deepgemm's 6.31 / 6.12 ms, so random operands chose
    the slower kernel. The cause is not established (power-limited clocks, which depend on the operands' bits, are
    the suspect)."""
    import tilehal

    key = (m_bucket(m), n, k, bias, device)
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - older torch
        import contextlib

        unset_fake_temporarily = contextlib.nullcontext
    with unset_fake_temporarily(), torch.no_grad():
        dev = torch.device("cuda", device)
        g = torch.Generator(dev).manual_seed(0)
        a = torch.randn((m, k), device=dev, generator=g).to(torch.bfloat16)
        if (isinstance(weight, torch.Tensor) and weight.shape == (n, k) and weight.dtype is torch.bfloat16
                and weight.device == dev and type(weight) in (torch.Tensor, torch.nn.Parameter)):
            w = weight.detach()
        else:
            w = torch.randn((n, k), device=dev, generator=g).to(torch.bfloat16)
        b16 = torch.randn((n,), device=dev, generator=g).to(torch.bfloat16) if bias else None
        b32 = b16.float() if bias else None

        def ours():
            d = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
            deepgemm.bf16_gemm_nt(a, w, d, bias=b32)
            return d

        t_dg = tilehal.bench(ours, warmup=2, iters=10, device="cuda", hide_host=False).median_s
        t_cb = tilehal.bench(lambda: torch.nn.functional.linear(a, w, b16), warmup=2, iters=10, device="cuda",
                             hide_host=False).median_s
    choice = bf16_pick(t_dg, t_cb)
    BF16_CHOICES[key], _BF16_TIMES[key] = choice, (t_dg, t_cb, m, choice)
    log.debug("bf16 GEMM %dx%dx%d%s: deepgemm %.1f us, cuBLAS %.1f us -> %s", m, n, k, " +bias" if bias else "",
              t_dg * 1e6, t_cb * 1e6, choice)
    return choice


def m_bucket(m: int) -> int:
    """The M a choice is kept for: the next power of two (the first M seen in a bucket decides for it, so a
    workload of many M values measures a few)."""
    return 1 << max(m - 1, 0).bit_length()


def bf16_gemm_choice(m: int, n: int, k: int, bias: bool, device: int, weight: torch.Tensor | None = None) -> str:
    """"deepgemm" or "cublas" for a bf16 GEMM [m, k] x [n, k]^T on CUDA device `device` (TILESTACK_BF16_GEMM;
    "auto" measures the first shape of each (M bucket, N, K) once, on `weight` when given (the caller's own),
    outside CUDA-graph capture; during a capture an unmeasured shape takes deepgemm)."""
    policy = bf16_policy()
    if policy != "auto":
        return policy
    key = (m_bucket(m), n, k, bias, device)
    hit = BF16_CHOICES.get(key)
    if hit is not None:
        return hit
    if m == 0 or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        log.debug("bf16 GEMM %dx%dx%d: not measured (%s), deepgemm", m, n, k,
                  "empty" if m == 0 else "inside a CUDA-graph capture")
        return "deepgemm"
    return _measure_bf16(m, n, k, bias, device, weight)


@torch._dynamo.assume_constant_result
def _traced_bf16_choice(m: int, n: int, k: int, bias: bool, device: int, handle: int = 0) -> str:
    # Called by torch.compile while tracing (a constant of the graph): measures with real tensors, the weight of
    # the GemmLinear `handle` names (tilestack.ops) where it is alive.
    from .ops import lookup

    layer = lookup(handle, missing_ok=True) if handle else None
    w = layer._parameters.get("weight") if isinstance(layer, torch.nn.Module) else None
    return bf16_gemm_choice(m, n, k, bias, device, w)


def bf16_choice_table() -> list[dict]:
    """Every bf16 shape measured in this process: its times and the choice (for reports)."""
    return [dict(m=t[2], m_bucket=k[0], n=k[1], k=k[2], bias=k[3], device=k[4], deepgemm_us=t[0] * 1e6,
                 cublas_us=t[1] * 1e6, choice=t[3]) for k, t in _BF16_TIMES.items()]


def cast_tokens(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """deepgemm.per_token_cast_to_fp8(x2, tma_aligned_sf=x2.is_cuda), or the cast a FusedRMSNorm(emit_fp8=True)
    already made of this very tensor (tilestack.norm.precast_fp8: same values, bit for bit)."""
    pre = norm.precast_fp8(x2) if x2.is_cuda else None
    return pre if pre is not None else deepgemm.per_token_cast_to_fp8(x2, tma_aligned_sf=x2.is_cuda)


class GemmLinear(torch.nn.Module):
    """y = x @ weight.T + bias with deepgemm's bf16 (default) or fp8 (`fp8=True`) GEMM, or FP4 weights
    (`fp4=True`; in_features % 128 == 0) with bf16 (or, with fp8=True, e4m3) activations."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, fp8: bool = False,
                 fp4: bool = False, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        in_features, out_features = _args.features(in_features, "in_features"), _args.features(out_features,
                                                                                                "out_features")
        bias, fp8 = _args.flag(bias, "bias"), _args.flag(fp8, "fp8")
        device, dtype = _args.device(device), _args.dtype(dtype)
        self.in_features, self.out_features, self.fp8 = in_features, out_features, fp8
        self.fp4 = _check_fp4(fp4, in_features)
        self.weight = _args.allocate(lambda: torch.nn.Parameter(torch.empty(out_features, in_features, device=device,
                                                                            dtype=dtype)),
                                     "in_features/out_features", (out_features, in_features))
        self.bias = (torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None)
        torch.nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's default
        self._cache: tuple[Any, Any] | None = None
        self._bias_cache: tuple[Any, torch.Tensor] | None = None
        self._logged_cpu = False
        self._routes: dict[tuple, str] = {}
        self._group: ProjectionGroup | None = None
        self.cublas_from_m: int | None = None
        ops.handle_of(self)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fp8: bool = False, fp4: bool = False) -> GemmLinear:
        """Wrap `linear`'s own parameters (shared, not copied), so state_dicts stay interchangeable."""
        if not isinstance(linear, torch.nn.Linear):
            raise ArgumentError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        fp8 = _args.flag(fp8, "fp8")
        out = cls.__new__(cls)
        torch.nn.Module.__init__(out)
        out.in_features, out.out_features, out.fp8 = linear.in_features, linear.out_features, fp8
        out.fp4 = _check_fp4(fp4, linear.in_features)
        out.weight = linear.weight
        out.bias = linear.bias
        out._cache, out._bias_cache, out._logged_cpu = None, None, False
        out._routes = {}
        out._group = None
        out.cublas_from_m = None
        ops.handle_of(out)
        return out

    def _gemm_weight(self) -> Any:
        """The weight in the GEMM's operand format, recomputed only when the weight changes."""
        w = self._parameters["weight"]  # (not self.weight: Module.__getattr__ is on every call's path)
        key = (w.data_ptr(), w._version, w.get_device(), w.dtype, self.fp8, self.fp4)
        cache = self._cache
        if cache is None or cache[0] != key:
            wd = w.detach()
            if self.fp4:
                val = deepgemm.cast_weights_to_fp4(wd, gran_k=FP4_GRAN_K)
            elif self.fp8:
                val = deepgemm.per_block_cast_to_fp8(wd)
            else:
                val = wd.to(torch.bfloat16).contiguous()
            self._cache = (key, val)
        return self._cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self._group
        if group is not None and not torch.compiler.is_compiling():
            y = group.output(self, x)
            if y is not None:
                return y
        # Fast path of an input signature already routed to cuBLAS (bf16, policy "auto"): nn.Linear's own call.
        if type(x) is torch.Tensor and self._routes and not torch.compiler.is_compiling() \
                and os.environ.get("TILESTACK_BF16_GEMM", "auto") == "auto":
            w = self._parameters["weight"]
            if self._routes.get((x.shape, x.dtype, x.device, w.dtype)) == "cublas":
                return torch.nn.functional.linear(x, w, self._parameters.get("bias"))
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ShapeError(f"x: expected a tensor [..., {self.in_features}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            raise RuntimeError("GemmLinear is inference-only (deepgemm records no autograd graph): run it under "
                               "torch.no_grad() / torch.inference_mode(), or set requires_grad=False")
        two_d = x.dim() == 2
        x2 = x if two_d else x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            if self._cublas_when_traced(x2):
                # cuBLAS measured faster for this shape: a plain linear, which inductor schedules (and fuses
                # around) exactly as in the unmodified model.
                y = torch.nn.functional.linear(x2, self.weight, self.bias)
            else:
                # One opaque node for torch.compile (tilestack.ops); its eager body is _forward_2d.
                y = torch.ops.tilestack.gemm_linear(x2, self.weight, self.bias, self._tilestack_handle)
        else:
            self._to_cublas = False
            y = self._forward_2d(x2)
            if self._to_cublas and bf16_policy() == "auto":
                # This input signature takes cuBLAS from now on without the checks (the forward's first lines).
                self._routes[(x.shape, x.dtype, x.device, self._parameters["weight"].dtype)] = "cublas"
        return y if two_d else y.view(*x.shape[:-1], self.out_features)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        ops.handle_of(self)      # a copy gets its own handle

    def _bf16_eligible(self, x2: torch.Tensor) -> bool:
        return (not self.fp8 and not self.fp4 and x2.is_cuda and x2.dtype is torch.bfloat16
                and self._parameters["weight"].dtype is torch.bfloat16)

    def _cublas_from_here(self, m: int) -> bool:
        """`cublas_from_m` (bf16, policy "auto"): from that M on cuBLAS whatever the stand-alone measurement
        says (register_optimizations sets it on a model's output embedding, where the model measured it)."""
        edge = getattr(self, "cublas_from_m", None)
        return edge is not None and m >= edge and bf16_policy() == "auto"

    def _cublas_when_traced(self, x2: torch.Tensor) -> bool:
        if not self._bf16_eligible(x2) or not isinstance(x2.shape[0], int):
            return False   # fp8 / fp4, or a dynamic M: the op (whose eager body still picks per shape)
        return self._cublas_from_here(x2.shape[0]) or _traced_bf16_choice(
            x2.shape[0], self.out_features, self.in_features, self._parameters.get("bias") is not None,
            x2.get_device(), self._tilestack_handle) == "cublas"

    def _forward_2d(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, in] -> [M, out] in x2's dtype (eager: the cached weight operand, deepgemm's kernel)."""
        if not x2.is_cuda and not self._logged_cpu:
            log.debug("GemmLinear %dx%d: input on %s, running deepgemm's CPU reference (the sm_90a kernels need "
                      "CUDA tensors)", self.out_features, self.in_features, x2.device)
            self._logged_cpu = True
        if self._bf16_eligible(x2) and x2.shape[0] and (self._cublas_from_here(x2.shape[0]) or bf16_gemm_choice(
                x2.shape[0], self.out_features, self.in_features, self._parameters.get("bias") is not None,
                x2.get_device(), self._parameters["weight"]) == "cublas"):
            self._to_cublas = True
            return torch.nn.functional.linear(x2, self._parameters["weight"], self._parameters.get("bias"))
        # bf16 out for a bf16 caller (the bias, in fp32, added in the GEMM's epilogue before the one rounding),
        # fp32 otherwise (rounded once to the caller's dtype at the end).
        out_dtype = torch.bfloat16 if x2.dtype == torch.bfloat16 else torch.float32
        d = torch.empty((x2.shape[0], self.out_features), dtype=out_dtype, device=x2.device)
        bias = self._bias32() if self._parameters.get("bias") is not None else None
        if x2.shape[0]:
            if self.fp4:
                # FP4 weights: no bias epilogue in that kernel, so an fp32 result and the bias added in fp32.
                dd = d if bias is None else torch.empty(d.shape, dtype=torch.float32, device=d.device)
                if self.fp8:
                    deepgemm.fp8_fp4_gemm_nt(deepgemm.per_token_cast_to_fp8(x2, tma_aligned_sf=x2.is_cuda),
                                             self._gemm_weight(), dd)
                else:
                    deepgemm.bf16_fp4_gemm_nt(x2.to(torch.bfloat16).contiguous(), self._gemm_weight(), dd)
                if bias is not None:
                    d.copy_(dd + bias)
            elif self.fp8:
                # On CUDA one fused cast kernel (or none: the RMSNorm before cast it), scales written in the layout
                # the GEMM reads (no transpose).
                deepgemm.fp8_gemm_nt(cast_tokens(x2), self._gemm_weight(), d, bias=bias)
            else:
                a = x2 if x2.dtype is torch.bfloat16 and x2.is_contiguous() else x2.to(torch.bfloat16).contiguous()
                deepgemm.bf16_gemm_nt(a, self._gemm_weight(), d, bias=bias)
        elif bias is not None:
            d += bias
        return d if d.dtype == x2.dtype else d.to(x2.dtype)

    def _forward_cast(self, a8: tuple[torch.Tensor, torch.Tensor], m: int) -> torch.Tensor:
        """fp8 layers: [M, out] bf16 from an activation already cast per token (e.g. by a fused activation
        kernel), scales MN-major as per_token_cast_to_fp8(..., tma_aligned_sf=True) returns them."""
        d = torch.empty((m, self.out_features), dtype=torch.bfloat16, device=a8[0].device)
        bias = self._bias32() if self._parameters.get("bias") is not None else None
        deepgemm.fp8_gemm_nt(a8, self._gemm_weight(), d, bias=bias)
        return d

    def _bias32(self) -> torch.Tensor:
        """The bias as a contiguous fp32 vector (the epilogue's operand), recomputed only when it changes."""
        bias = self._parameters["bias"]
        key = (bias.data_ptr(), bias._version, bias.get_device(), bias.dtype)
        hit = self._bias_cache
        if hit is None or hit[0] != key:
            hit = (key, bias.detach().float().contiguous())
            self._bias_cache = hit
        return hit[1]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8={self.fp8}, fp4={self.fp4}" + (", grouped" if self._group is not None else ""))


# ----------------------------------------------------------------------------- sibling projections, one GEMM

# Sibling Linears that read the same input in transformers' blocks: the attention projections (Llama, Mistral,
# Qwen2/3, Mixtral, Qwen-MoE, ...). The first one listed is the one the forward calls first.
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"),)


def projection_group_skip_reason(members: list[torch.nn.Module]) -> str | None:
    """Why these GemmLinears cannot share one GEMM, or None."""
    if not all(type(m) is GemmLinear and m._group is None for m in members):
        return "not all of them are (ungrouped) GemmLinears"
    ws = [m._parameters["weight"] for m in members]
    if len({(m.in_features, m.fp8, m.fp4) for m in members}) != 1 or any(m.fp4 for m in members):
        return "their in_features or precisions differ (or FP4 weights)"
    if len({(w.dtype, w.device) for w in ws}) != 1:
        return "their weights' dtypes or devices differ"
    biases = [m._parameters.get("bias") for m in members]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return "some have a bias and some do not"
    if members[0].fp8 and any(m.out_features % 128 for m in members[:-1]):
        return "fp8: every output block but the last must be a multiple of 128 rows (128x128 weight scales)"
    return None


class ProjectionGroup:
    """GemmLinears that read the same input (an attention block's q/k/v projections) computed as ONE GEMM on
    their concatenated weight (and bias): the first member's forward computes every member's output and keeps
    them; each other member, called with the same input tensor (same storage, shape, strides and version:
    nothing written to it since), returns its slice (a view of the one output; non-contiguous, rows of
    sum(out_features)). A member called with another input, or before the first, computes alone. The members'
    parameters become views of the concatenated tensors (nothing copied is kept; state_dict keys and values are
    unchanged); if one is replaced (load_state_dict with assign, .to()), the concatenation is rebuilt on the next
    call. Eager only: under torch.compile each member runs on its own.

    Eager host work for q/k/v: one GEMM launch (fp8: and one activation cast) instead of three."""

    def __init__(self, members: list[GemmLinear]) -> None:
        why = projection_group_skip_reason(members)
        if why is not None:
            raise ArgumentError(f"members: expected GemmLinears that can share one GEMM, got {why}")
        self.members = list(members)
        self.sizes = [m.out_features for m in members]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(members))]
        self.fused: GemmLinear | None = None
        self._pending: tuple | None = None     # (input signature, outputs, members taken, the input kept alive)
        self._fuse_storage()
        for i, m in enumerate(members):
            m._group, m._group_index = self, i

    def _fuse_storage(self) -> None:
        ws = [m._parameters["weight"] for m in self.members]
        bs = [m._parameters.get("bias") for m in self.members]
        with torch.no_grad():
            w = torch.cat([x.detach() for x in ws])
            b = torch.cat([x.detach() for x in bs]) if bs[0] is not None else None
            for i, x in enumerate(ws):
                x.data = w[self.offsets[i]: self.offsets[i] + self.sizes[i]]
            if b is not None:
                for i, x in enumerate(bs):
                    x.data = b[self.offsets[i]: self.offsets[i] + self.sizes[i]]
        lin = torch.nn.Linear(1, 1, bias=b is not None, device="meta")
        lin.in_features, lin.out_features = w.shape[1], w.shape[0]
        lin.weight = torch.nn.Parameter(w, requires_grad=ws[0].requires_grad)
        if b is not None:
            lin.bias = torch.nn.Parameter(b, requires_grad=bs[0].requires_grad)
        self.fused = GemmLinear.from_linear(lin, fp8=self.members[0].fp8)
        self._pending = None

    def _views_intact(self) -> bool:
        fw, fb = self.fused._parameters["weight"], self.fused._parameters.get("bias")
        for i, m in enumerate(self.members):
            w, b = m._parameters["weight"], m._parameters.get("bias")
            step = self.offsets[i] * fw.shape[1] * fw.element_size()
            if w.dtype != fw.dtype or w.data_ptr() != fw.data_ptr() + step or w.shape[0] != self.sizes[i]:
                return False
            if fb is not None and (b is None or b.dtype != fb.dtype
                                   or b.data_ptr() != fb.data_ptr() + self.offsets[i] * fb.element_size()):
                return False
        return True

    def output(self, member: GemmLinear, x: torch.Tensor) -> torch.Tensor | None:
        """`member`'s output for x from the group's GEMM, or None (the member computes alone)."""
        if type(x) is not torch.Tensor or x.dim() < 1 or x.shape[-1] != member.in_features or (
                torch.is_grad_enabled() and (x.requires_grad or member._parameters["weight"].requires_grad)):
            return None
        i = member._group_index
        sig = (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x._version)
        p = self._pending
        if p is not None and p[0] == sig and i not in p[2]:
            p[2].add(i)
            if len(p[2]) == len(self.members):
                self._pending = None           # every member served: drop the outputs and the input
            return p[1][i]
        if i != 0:
            return None
        if not self._views_intact():
            self._fuse_storage()
        x2 = x if x.dim() == 2 else x.reshape(-1, member.in_features)
        y = self.fused._forward_2d(x2)
        lead = x.shape[:-1]
        outs = [y[:, o: o + n] if x.dim() == 2 else y[:, o: o + n].view(*lead, n)
                for o, n in zip(self.offsets, self.sizes)]
        self._pending = (sig, outs, {0}, x)
        return outs[0]


FP4_GRAN_K = 32  # K width of one FP4 weight scale (DeepGEMM's MXFP4 block)


def _check_fp4(fp4: Any, in_features: int) -> bool:
    if not isinstance(fp4, bool):
        raise ValueError(f"fp4: expected a bool, got {fp4!r}")
    if fp4 and in_features % 128:
        raise ShapeError(f"in_features: expected a multiple of 128 for FP4 weights (fp4=True), got {in_features}")
    return fp4


# transformers' dense gated MLPs: forward = down_proj(act_fn(gate_proj(x)) * up_proj(x)). (The MoE models'
# shared-expert MLP classes are left to ExpertParallelMoE's own handling.)
SWIGLU_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})


def swiglu_skip_reason(module: torch.nn.Module) -> str | None:
    """Why `module` is not a gated SiLU MLP GemmSwiGLU reproduces, or None."""
    if type(module).__name__ not in SWIGLU_MLP_CLASSES:
        return f"{type(module).__name__} is not one of {sorted(SWIGLU_MLP_CLASSES)}"
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(type(p) is not torch.nn.Linear for p in parts):
        return "gate_proj / up_proj / down_proj are not all nn.Linear"
    if any(p.bias is not None for p in parts):
        return "the projections have biases (fused only without)"
    if parts[0].weight.shape != parts[1].weight.shape:
        return "gate_proj and up_proj differ in shape"
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):  # transformers' F.silu module
        return f"act_fn is {type(act).__name__}, not SiLU"
    return None


# (M bucket, hidden, ffn, fp8, device) -> "fused" | "unfused": which GemmSwiGLU path measured faster here (on
# the H200 the fused one was 0.45 ms slower per 2-layer Llama-3-8B-shaped prefill of 4096 tokens and 68 us
# faster per decode step of 64; TILESTACK_SWIGLU=fused|unfused forces one).
SWIGLU_CHOICES: dict[tuple, str] = {}
_SWIGLU_TIMES: dict[tuple, tuple[float, float, int, str]] = {}  # key -> (fused s, unfused s, M, choice)


def swiglu_choice_table() -> list[dict]:
    """Every GemmSwiGLU shape measured in this process: its times and the path taken (for reports)."""
    return [dict(m=t[2], m_bucket=k[0], hidden=k[1], ffn=k[2], fp8=k[3], device=k[4], fused_us=t[0] * 1e6,
                 unfused_us=t[1] * 1e6, choice=t[3]) for k, t in _SWIGLU_TIMES.items()]


class GemmSwiGLU(torch.nn.Module):
    """A transformers gated MLP, down(silu(gate(x)) * up(x)), on deepgemm in three steps: gate and up as ONE
    GEMM on their concatenated weight, silu(gate) * up in one kernel (fp32 math, one rounding; with fp8 cast
    per token straight into the down GEMM's e4m3 operand), then down. Eager host work: 2 GEMM launches and
    1 activation kernel instead of 3 GEMMs + silu + mul (+ 3 casts with fp8). Per (M bucket, shape) it takes
    whichever of that path and the original three-GEMM forward measured faster here (SWIGLU_CHOICES).

    Parameters stay the original Linears' (`gate_proj.weight`, ... : state_dict keys unchanged). For bf16,
    gate's and up's weights become views of one [2F, H] tensor at construction (no copy of the weights
    kept); if either is later replaced, the concatenation is rebuilt on the next call. Under
    torch.compile, on the CPU or for a non-bf16 input it runs the three GemmLinears as the original does.
    """

    def __init__(self, mlp: torch.nn.Module, fp8: bool = False) -> None:
        super().__init__()
        self.gate_proj = GemmLinear.from_linear(mlp.gate_proj, fp8=fp8)
        self.up_proj = GemmLinear.from_linear(mlp.up_proj, fp8=fp8)
        self.down_proj = GemmLinear.from_linear(mlp.down_proj, fp8=fp8)
        self.act_fn = mlp.act_fn
        self.fp8 = fp8
        self._gu: tuple[Any, Any] | None = None
        self._fuse_storage()

    def _fuse_storage(self) -> torch.Tensor:
        """gate's and up's weights as views of one [2F, H] tensor (returned)."""
        g, u = self.gate_proj._parameters["weight"], self.up_proj._parameters["weight"]
        with torch.no_grad():
            fused = torch.cat([g.detach(), u.detach()])
            g.data = fused[: g.shape[0]]
            u.data = fused[g.shape[0]:]
        self._fused = fused
        self._gu = None
        return fused

    def _gate_up_operand(self) -> Any:
        """The concatenated weight in the GEMM's operand format (bf16 [2F, H], or its fp8 per-block cast)."""
        g, u = self.gate_proj._parameters["weight"], self.up_proj._parameters["weight"]
        fused = self._fused
        step = g.shape[0] * g.shape[1] * g.element_size()
        if g.data_ptr() != fused.data_ptr() or u.data_ptr() != fused.data_ptr() + step or g.dtype != fused.dtype:
            fused = self._fuse_storage()  # a weight was replaced: concatenate again
        key = (fused.data_ptr(), fused._version, fused.get_device(), fused.dtype, self.fp8)
        gu = self._gu
        if gu is None or gu[0] != key:
            val = deepgemm.per_block_cast_to_fp8(fused) if self.fp8 else fused.to(torch.bfloat16).contiguous()
            gu = self._gu = (key, val)
        return gu[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (torch.compiler.is_compiling() or not isinstance(x, torch.Tensor) or not x.is_cuda
                or x.dtype is not torch.bfloat16 or x.dim() < 1 or x.shape[-1] != self.gate_proj.in_features
                or torch.is_grad_enabled() and x.requires_grad):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        if torch.is_grad_enabled() and self.gate_proj.weight.requires_grad:
            raise RuntimeError("GemmSwiGLU is inference-only (deepgemm records no autograd graph): run it under "
                               "torch.no_grad() / torch.inference_mode(), or set requires_grad=False")
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        m = x2.shape[0]
        if not m:
            y = torch.empty((0, self.down_proj.out_features), dtype=torch.bfloat16, device=x2.device)
        elif self._path(x2) == "fused":
            y = self._fused_path(x2)
        else:
            y = self._unfused(x2)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.down_proj.out_features)

    def _fused_path(self, x2: torch.Tensor) -> torch.Tensor:
        """gate|up as one GEMM, silu(gate) * up in one kernel, down (the `_fused` attribute is the [2F, H] weight)."""
        m = x2.shape[0]
        h = torch.empty((m, 2 * self.gate_proj.out_features), dtype=torch.bfloat16, device=x2.device)
        if self.fp8:
            deepgemm.fp8_gemm_nt(cast_tokens(x2), self._gate_up_operand(), h)
            return self.down_proj._forward_cast(deepgemm.silu_mul_cast_to_fp8(h, tma_aligned_sf=True), m)
        gu = self._gate_up_operand()
        if bf16_gemm_choice(m, gu.shape[0], gu.shape[1], False, x2.get_device(), gu) == "cublas":
            torch.mm(x2, gu.t(), out=h)
        else:
            deepgemm.bf16_gemm_nt(x2, gu, h)
        return self.down_proj._forward_2d(deepgemm.silu_mul(h))

    def _unfused(self, x2: torch.Tensor) -> torch.Tensor:
        """The original module's forward on the three GemmLinears."""
        return self.down_proj(self.act_fn(self.gate_proj(x2)) * self.up_proj(x2))

    def _path(self, x2: torch.Tensor) -> str:
        """"fused" or "unfused" for this input's (M bucket, shape, precision, device): TILESTACK_SWIGLU, else the
        faster of the two measured once on this input (eager, host time included; during a CUDA-graph capture an
        unmeasured shape takes the fused path)."""
        policy = os.environ.get("TILESTACK_SWIGLU", "auto")
        if policy in ("fused", "unfused"):
            return policy
        key = (m_bucket(x2.shape[0]), self.gate_proj.in_features, self.gate_proj.out_features, self.fp8,
               x2.get_device())
        hit = SWIGLU_CHOICES.get(key)
        if hit is not None:
            return hit
        if torch.cuda.is_current_stream_capturing():
            log.debug("GemmSwiGLU M=%d: not measured (inside a CUDA-graph capture), fused", x2.shape[0])
            return "fused"
        import tilehal

        t_f = tilehal.bench(lambda: self._fused_path(x2), warmup=2, iters=5, device="cuda", hide_host=False).median_s
        t_u = tilehal.bench(lambda: self._unfused(x2), warmup=2, iters=5, device="cuda", hide_host=False).median_s
        choice = "fused" if t_f <= t_u else "unfused"
        SWIGLU_CHOICES[key], _SWIGLU_TIMES[key] = choice, (t_f, t_u, x2.shape[0], choice)
        log.debug("GemmSwiGLU M=%d H=%d F=%d%s: fused %.1f us, three GEMMs %.1f us -> %s", x2.shape[0],
                  key[1], key[2], " fp8" if self.fp8 else "", t_f * 1e6, t_u * 1e6, choice)
        return choice

    def extra_repr(self) -> str:
        return f"hidden={self.gate_proj.in_features}, ffn={self.gate_proj.out_features}, fp8={self.fp8}"
