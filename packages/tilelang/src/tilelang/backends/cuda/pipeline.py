"""The CUDA target's ordered pass list (one readable place; the public TileLang's cuda pipeline
and Triton's `add_stages` are the models). Each entry: the pass and why it runs where it does.

IR-level passes run on the tile IR (shared with the other targets); the lowering steps after
them run inside `KernelCodegen`, in this order, on each T.Kernel.
"""

from __future__ import annotations

from ...passes.checks import check_shapes
from ...passes.dce import dce
from ...passes.simplify import simplify
from .unswitch import fold_clears, unswitch_masks

# (pass, why) — run by passes.pipeline.run_pipeline
IR_PASSES = [
    (simplify, "fold constants and index arithmetic first: the checks and the alignment and bounds proofs "
               "below see simple forms"),
    (check_shapes, "reject malformed tile ops (verify: scopes, ranks, static bounds, on the simplified IR) "
                   "before anything GPU-specific, so later errors are about the GPU, not the program; the one "
                   "verify of this list (a second one after dce cost ~10% of a cached compile, and dce only "
                   "removes code)"),
    (dce, "drop dead buffers before layout inference, so they constrain no layout and take no smem"),
    (unswitch_masks, "after the checks (the rewritten nest is well-formed by construction) and before layout "
                     "inference (both branches' stores then get the fragment's layout): a masked T.Parallel "
                     "fill whose condition holds on the whole tile stores the plain value (causal attention "
                     "off the diagonal)"),
    (fold_clears, "with the masks unswitched: a T.clear right before a T.gemm into the whole accumulator "
                  "becomes the gemm's clear_accum (the first MMA step ignores C; no per-iteration zeroing)"),
]

# the lowering steps KernelCodegen runs, in order (documentation of the code path; see codegen.py)
LOWERING_STEPS = [
    ("check threads", "threads a multiple of 32 (whole warps) and <= 1024: every later step assumes warps"),
    ("plan gemms", "each T.gemm picks wgmma (sm_90a, warpgroups), mma.sync (warp grid from its policy) or CUDA "
                   "cores; fixes accumulator layouts, which everything else then follows (a kernel whose wgmma "
                   "layouts conflict keeps mma.sync)"),
    ("layout inference", "fragments used as scalars replicate; T.Parallel loops, reductions and fragment copies "
                         "propagate to a fixed point; defaults for the rest"),
    ("swizzle planning", "shared operands of mma get an XOR swizzle so ldmatrix rows hit distinct banks"),
    ("pipeline planning", "T.Pipelined(num_stages>=2): global->shared copies that depend only on the loop index "
                          "become prefetches into num_stages buffers: TMA + mbarrier on sm_90a (warp-specialized: a "
                          "producer warpgroup; opt-in persistent / pingpong), else cp.async; a block index that "
                          "lengthens the loop is dispatched longest first"),
    ("lower tile ops + barriers", "copies/fills/reductions/gemms become a thread-level program (lower_thread.py: "
                                  "the one emit.py prints and the thread interpreter runs); __syncthreads() between "
                                  "statements with a shared (or written global) hazard"),
    ("shared memory planning", "after lowering, since reductions and staging add scratch: buffers with disjoint "
                               "live ranges share bytes; over 227 KiB is a CompileError"),
    ("compile", "NVRTC to an sm_90a cubin, cached on disk by content hash (tilehal.compile_cuda)"),
]


def passes(options: dict) -> list:
    return [p for p, _ in IR_PASSES]
