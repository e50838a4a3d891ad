"""Build a lowered PrimFunc into a cubin (NVRTC) and launch it on torch's current stream."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import tilehal

from ...errors import CompileError
from ...ir.nodes import AtomicAdd, Const, Expr, Kernel, PrimFunc, Var
from ...ir.visit import walk_stmts
from .codegen import generate_cuda, math_options

log = logging.getLogger("tilelang.backends.cuda")

DEFAULT_ARCH = "sm_90a"


def _eval(e: Expr, dyn: dict[Var, int]) -> int:
    from ..interp import Interpreter

    it = Interpreter.__new__(Interpreter)
    it.env = dict(dyn)
    it.bufs = {}
    return int(it.expr(e))


class CudaKernel:
    device = "cuda"
    from_kernel_cache = False  # built from the kernel cache's source, without lowering

    def __init__(self, func: PrimFunc, options: dict,
                 generated: tuple[str, list[tuple[str, Kernel, int]], dict] | None = None) -> None:
        """Generate (or, from the kernel cache, take `generated`: source, kernels, TMA specs) and build."""
        self.func = func
        arch = options.get("arch", DEFAULT_ARCH)
        if generated is None:
            self.cuda_source, self.kernels, self.tma, self.launch_threads = generate_source(func, options)
        else:
            self.cuda_source, self.kernels, self.tma, self.launch_threads = generated
        self._descs: dict = {}
        t0 = time.perf_counter()
        opts = tuple(options.get("nvrtc_options", ()))
        self.module = tilehal.compile_cuda(self.cuda_source, arch=arch, name=func.name, options=opts)
        self.compile_seconds = time.perf_counter() - t0
        self.cache_hit = self.module.cache_hit
        self.atomic_outputs = {s.dst.buffer for s in walk_stmts(func.body) if isinstance(s, AtomicAdd)}
        self._static_grids = []
        for name, k, smem in self.kernels:
            grid = [int(g.value) if isinstance(g, Const) else None for g in k.grid]
            threads = 1
            for t in k.threads:
                threads *= int(t)
            lt = self.launch_threads.get(name)  # [+ a producer warpgroup, persistent tiles]
            if lt:
                threads = lt[0]
            self._static_grids.append((self.module.get_kernel(name), k, grid, threads, smem))
        log.debug("built %s (%d kernel(s)) in %.3fs (cache hit: %s)", self.kernels[0][0], len(self.kernels),
                  self.compile_seconds,
                  self.cache_hit)

    def source(self) -> str:
        return self.cuda_source

    def zero_output(self, index: int) -> bool:
        """Outputs that atomics accumulate into start at zero; others are fully written by the kernel."""
        return self.func.params[index] in self.atomic_outputs

    def __call__(self, args: list[Any], dyn: dict[Var, int]) -> None:
        for p, a in zip(self.func.params, args):
            if a.data_ptr() % 16:
                raise tilehal.ShapeError(f"{p.name}: the CUDA kernel needs a 16-byte aligned data pointer, got "
                                         f"address {a.data_ptr():#x} (a view with a storage offset?)")
        sizes = [int(dyn[v]) for v in self.func.dynamic_vars]
        for (kern, k, grid, threads, smem), (name, _, _) in zip(self._static_grids, self.kernels):
            lt = self.launch_threads.get(name)
            if lt and lt[1]:  # persistent: one block per SM (at most one per tile), looping over the tiles
                g = [min(int(lt[1]), _sm_count())]
            else:
                g = [x if x is not None else _eval(e, dyn) for x, e in zip(grid, k.grid)]
            if any(x <= 0 for x in g):
                continue
            descs = [self._descriptor(spec, args[spec.param]) for spec in self.tma.get(name, ())]
            cluster = tuple(lt[2]) if lt and len(lt) > 2 else None  # TMA multicast: 2-CTA clusters
            kern.launch(g, threads, [*args, *sizes, *descs], smem_bytes=smem, cluster=cluster)

    def _descriptor(self, spec: Any, t: Any) -> bytes:
        """The TMA descriptor of `spec` over tensor `t` (a 2-D view: leading dims as rows), cached per
        address and shape (a moved tensor of one shape gets its address swapped in)."""
        from tilehal import tma

        from .rules.tma import tma_param_shape

        rows, cols = tma_param_shape(tuple(t.shape))
        key = (spec, rows, cols)
        ptr = t.data_ptr()
        hit = self._descs.get(key)
        if hit is not None and hit[0] == ptr:
            return hit[1]
        desc = None
        if hit is not None:
            desc = tma.retarget(hit[1], ptr)
        if desc is None:
            desc = tma.encode_tiled(t, spec.dtype, (rows, cols), (cols, 1), (spec.box_rows, spec.box_cols),
                                            swizzle=spec.swizzle)
        self._descs[key] = (ptr, desc)
        return desc


_SMS: dict[int, int] = {}


def _sm_count() -> int:
    import torch

    dev = torch.cuda.current_device()
    if dev not in _SMS:
        _SMS[dev] = int(torch.cuda.get_device_properties(dev).multi_processor_count)
    return _SMS[dev]


def generate_source(func: PrimFunc, options: dict) -> tuple[str, list[tuple[str, Kernel, int]], dict, dict]:
    """The CUDA source of lowered `func` under `options` (pass_configs and arch): (source, [(kernel name,
    Kernel, smem bytes)], {kernel name: [TmaSpec]}, {kernel name: [launch threads, persistent tiles] where the
    launch differs from the T.Kernel's: warp-specialized kernels add a producer warpgroup, persistent ones
    loop over their tiles}), the kernels named by the source's content hash."""
    arch = options.get("arch", DEFAULT_ARCH)
    # wgmma needs the arch-specific sm_90a target; pass_configs {"tl.disable_wgmma": True} keeps mma.sync
    wgmma = arch == "sm_90a" and not options.get("tl.disable_wgmma")
    if not wgmma:
        log.debug("%s: wgmma off (arch %s, tl.disable_wgmma=%r): T.gemm uses mma.sync", func.name, arch,
                  options.get("tl.disable_wgmma"))
    # generated once under a placeholder name, then named by its content hash
    tma: dict = {}
    # pipelined tile copies through TMA on sm_90a by default; pass_configs tl.disable_tma_lower (or
    # cuda_tma=False) keeps cp.async (each copy's choice is logged at DEBUG by rules/tma.py)
    use_tma = bool(options.get("cuda_tma", True)) and not options.get("tl.disable_tma_lower")
    if not use_tma:
        log.debug("%s: TMA off (tl.disable_tma_lower=%r, cuda_tma=%r): pipelined copies use cp.async",
                  func.name, options.get("tl.disable_tma_lower"), options.get("cuda_tma"))
    # warp specialization of TMA pipelines (a producer warpgroup issues the loads) by default on sm_90a;
    # pass_configs tl.disable_warp_specialized (or cuda_warp_specialize=False) keeps the single-role pipeline
    ws = bool(options.get("cuda_warp_specialize", True)) and not options.get("tl.disable_warp_specialized")
    if not ws:
        log.debug("%s: warp specialization off (tl.disable_warp_specialized=%r, cuda_warp_specialize=%r)",
                  func.name, options.get("tl.disable_warp_specialized"), options.get("cuda_warp_specialize"))
    launch: dict = {}
    probe, kernels = generate_cuda(func, "tl_kernel", wgmma=wgmma, tma=tma, use_tma=use_tma,
                                   one_barrier=bool(options.get("cuda_wgmma_one_barrier")),
                                   warp_specialize=ws and use_tma, launch=launch,
                                   persistent=bool(options.get("cuda_persistent")),
                                   pingpong=bool(options.get("cuda_ws_pingpong")),
                                   overlap=bool(options.get("cuda_ws_overlap", False)),
                                   multicast=bool(options.get("cuda_ws_multicast")),
                                   split_stages=bool(options.get("cuda_ws_split_stages")),
                                   two_ctas=bool(options.get("cuda_ws_two_ctas")),
                                   math=math_options(options))
    digest = hashlib.sha256(probe.encode()).hexdigest()[:12]
    base = f"tl_{func.name}_{digest}"
    cuda_source = probe.replace("tl_kernel_k", f"{base}_k")
    kernels_named = [(name.replace("tl_kernel", base, 1), k, smem) for name, k, smem in kernels]
    tma_named = {name.replace("tl_kernel", base, 1): specs for name, specs in tma.items()}
    launch_named = {name.replace("tl_kernel", base, 1): t for name, t in launch.items()}
    return cuda_source, kernels_named, tma_named, launch_named


def compile_cuda_kernel(func: PrimFunc, options: dict, lower: Callable[[], PrimFunc]) -> CudaKernel:
    """Build `func` (as written; `lower()` runs the target's IR passes on it), or find it in the kernel
    cache (kernel_cache.py): a hit skips the IR passes and code generation (`.from_kernel_cache`)."""
    from tilehal.cache import cached_build

    from .kernel_cache import cache_key, pack, unpack

    key = cache_key(func, options)
    built: dict[str, CudaKernel] = {}

    def build(work) -> bytes:
        built["k"] = k = build_cuda_kernel(lower(), options)
        return pack(k.cuda_source, k.kernels, k.tma, k.launch_threads)

    art = cached_build("tilelang_cuda", key, "kernel.json", build)
    if "k" in built:
        return built["k"]
    got = unpack(func, art.data)
    if got is None:
        log.debug("%s: kernel cache entry %s does not fit this program; building it", func.name, key)
        return build_cuda_kernel(lower(), options)
    log.debug("%s: kernel cache hit %s (no lowering)", func.name, key)
    try:
        k = CudaKernel(func, options, got)
    except tilehal.CompileError as e:
        raise CompileError(f"{func.name}: the cached CUDA failed to compile: {e}", func.loc,
                           log=getattr(e, "log", "")) from e
    k.from_kernel_cache = True
    return k


def build_cuda_kernel(func: PrimFunc, options: dict) -> CudaKernel:
    try:
        return CudaKernel(func, options)
    except tilehal.CompileError as e:
        if isinstance(e, CompileError):
            raise
        raise CompileError(f"{func.name}: the generated CUDA failed to compile: {e}", func.loc,
                           log=getattr(e, "log", "")) from e
