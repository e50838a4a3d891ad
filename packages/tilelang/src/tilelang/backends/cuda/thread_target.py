"""Target "cuda_threads" (testing): the CUDA backend's thread-level program on the thread interpreter.

Kept apart from lower_thread.py (the node builder codegen and its rules use) because it drives the
whole codegen: lower_thread -> codegen -> rules -> lower_thread would otherwise be an import circle.
"""

from __future__ import annotations

import numpy as np

from ...errors import CompileError
from ...ir.nodes import Buffer, Kernel, Let, PrimFunc, Seq, Stmt, Var
from .codegen import KernelCodegen, generate_cuda, math_options


def lower_to_threads(func: PrimFunc, wgmma: bool = False, use_tma: bool = False,
                     one_barrier: bool = False, math: frozenset[str] = frozenset()) -> PrimFunc:
    """The thread-level program of lowered `func` (after the CUDA IR passes): the program the CUDA
    source is printed from, its tensors flat (params in order, each a 1-D view). Defaults: the
    mma.sync / cp.async path (the thread interpreter has no wgmma / TMA rules yet)."""
    body = func.body.body if isinstance(func.body, Seq) else [func.body]
    lets: list[Let] = []
    kernels: list[Stmt] = []
    shared: dict[Buffer, Buffer] = {}
    for s in body:
        if isinstance(s, Let):
            lets.append(s)
        elif isinstance(s, Kernel):
            cg = KernelCodegen(func, s, f"tl_kernel_k{len(kernels)}", list(lets), wgmma=wgmma, tma=use_tma,
                               one_barrier=one_barrier, math=math)
            cg._tbufs = shared  # one flat buffer per tensor across the kernels
            for p in func.params:
                cg.tbuf(p)
            cg.generate()
            kernels.append(cg.thread_kernel())
        elif isinstance(s, Seq) and not s.body:
            continue
        else:
            raise CompileError(f"cuda: statements outside T.Kernel ({type(s).__name__}) are not supported", s.loc)
    params = [shared[p] for p in func.params]
    return PrimFunc(func.name, params, Seq(kernels), list(func.dynamic_vars), loc=func.loc)


class ThreadLoweredKernel:
    """Target "cuda_threads" (testing): the CUDA backend's thread-level program run by the thread
    interpreter (backends/thread_interp.py: the block's threads as numpy lanes); `source()` is the CUDA
    printed from that same program."""

    device = "cpu"
    compile_seconds = 0.0
    cache_hit = False

    def __init__(self, func: PrimFunc, options: dict) -> None:
        from ...ir.verifier import verify_thread

        self.func = func
        # the mma.sync / cp.async path (cuda_emu's) by default; pass_configs {"cuda_tma": True}: sm_90a's wgmma
        # and single-role TMA pipelines (target "cuda" warp-specializes them by default: that form is still
        # text), with "tl.disable_tma_lower": wgmma and cp.async
        wgmma = bool(options.get("cuda_tma"))
        tma = wgmma and not options.get("tl.disable_tma_lower")
        # verified as a thread-level program: no barrier or shuffle under a per-thread condition, loop bounds
        # every thread agrees on, no per-thread storage but registers (ir/verifier.py verify_thread)
        one = bool(options.get("cuda_wgmma_one_barrier"))
        math = math_options(options)  # cuda_tree_reduce: its partials
        self.thread_program = verify_thread(lower_to_threads(func, wgmma=wgmma, use_tma=tma, one_barrier=one,
                                                             math=math))
        self.cuda_source = generate_cuda(func, f"tl_{func.name}", wgmma=wgmma, use_tma=tma, one_barrier=one,
                                         math=math)[0]

    def source(self) -> str:
        return self.cuda_source

    def __call__(self, arrays: list[np.ndarray], dyn: dict[Var, int]) -> None:
        from ..thread_interp import ThreadInterpreter

        flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
        ThreadInterpreter(self.thread_program).run(dict(zip(self.thread_program.params, flat)), dict(dyn))
        for a, f in zip(arrays, flat):
            if not np.shares_memory(a, f):
                a[...] = f.reshape(a.shape)


__all__ = ["ThreadLoweredKernel", "lower_to_threads"]
