"""`tilelang.PassConfigKey` and the checking of `pass_configs=`.

The keys are the public TileLang's names (so kernels that pass them port unchanged). Each key
is either honored on the CPU targets or logged (INFO) as having no effect there; keys that
are neither one of these nor one of ours are an error, since a misspelt key would otherwise
be dropped silently.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import tilehal

log = logging.getLogger("tilelang.pass_config")


class PassConfigKey(str, enum.Enum):
    TL_SIMPLIFY = "tl.Simplify"
    TL_DISABLE_WARP_SPECIALIZED = "tl.disable_warp_specialized"
    TL_DISABLE_TMA_LOWER = "tl.disable_tma_lower"
    TL_DISABLE_WGMMA = "tl.disable_wgmma"
    TL_ENABLE_FAST_MATH = "tl.enable_fast_math"
    TL_PTXAS_REGISTER_USAGE_LEVEL = "tl.ptxas_register_usage_level"
    TL_DEVICE_COMPILE_FLAGS = "tl.device_compile_flags"
    TL_ENABLE_PTXAS_VERBOSE_OUTPUT = "tl.enable_ptxas_verbose_output"
    TL_CONFIG_INDEX_BITWIDTH = "tl.config_index_bitwidth"
    TL_DISABLE_SAFE_MEMORY_ACCESS = "tl.disable_safe_memory_legalize"
    TL_DISABLE_OUT_OF_BOUND_WARNING = "tl.disable_out_of_bound_warning"
    TL_ENABLE_ASYNC_COPY = "tl.enable_async_copy"
    TL_DISABLE_SHARED_MEMORY_REUSE = "tl.disable_shared_memory_reuse"
    TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE = "tl.enable_aggressive_shared_memory_merge"
    TL_DISABLE_THREAD_STORAGE_SYNC = "tl.disable_thread_storage_sync"
    TL_DISABLE_SHUFFLE_ELECT = "tl.disable_shuffle_elect"
    TL_DISABLE_LOOP_UNSWITCHING = "tl.disable_loop_unswitching"
    TL_DISABLE_DATA_RACE_CHECK = "tl.disable_data_race_check"
    TL_DISABLE_BUFFER_INIT_CHECK = "tl.disable_buffer_init_check"
    TL_FORCE_LET_INLINE = "tl.force_let_inline"
    TL_LAYOUT_COST_MODEL = "tl.layout_cost_model"
    TL_ENABLE_DUMP_IR = "tl.enable_dump_ir"
    TL_DUMP_IR_DIR = "tl.dump_ir_path"
    TL_AST_PRINT_ENABLE = "tl.ast_print_enable"
    TL_EMIT_LINE_DIRECTIVES = "tl.emit_line_directives"
    TIR_DISABLE_VECTORIZE = "tirx.disable_vectorize"
    TIR_DISABLE_CSE = "tirx.disable_cse_tir"
    TIR_SIMPLIFY = "tirx.Simplify"
    TIR_DISABLE_STORAGE_REWRITE = "tirx.disable_storage_rewrite"
    TIR_USE_ASYNC_COPY = "tirx.use_async_copy"
    TIR_ENABLE_DEBUG = "tirx.enable_debug"
    TIR_MERGE_STATIC_SMEM = "tirx.merge_static_smem"
    TIR_NOALIAS = "tirx.noalias"
    CUDA_KERNELS_OUTPUT_DIR = "cuda.kernels_output_dir"

    def __str__(self) -> str:
        return self.value


# What the CPU targets do with each public key (anything not here: logged as no effect on CPU).
HONORED_ON_CPU = {
    PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS.value: "global element stores are not bounds-guarded",
    PassConfigKey.TIR_DISABLE_VECTORIZE.value: "the vectorize_hints pass is skipped",
}
# Our own keys (documented in docs/tilelang.md).
OWN_KEYS = {"c_flags", "disable_passes", "cuda_tma", "cuda_wgmma_one_barrier", "cuda_warp_specialize",
            "cuda_persistent", "cuda_ws_pingpong", "cuda_ws_overlap", "cuda_ws_multicast",
            "cuda_ws_split_stages", "cuda_ws_two_ctas", "cuda_fast_exp2", "cuda_fmnmx",
            "cuda_tree_reduce", "cuda_fast_div", "cuda_ws_split_producers"}  # docs/tilelang.md
_KNOWN = {k.value for k in PassConfigKey} | {"tir.disable_vectorize", "tir.noalias", "tir.disable_cse_tir"}


def check_pass_configs(configs: dict | None, target: str) -> dict[str, Any]:
    """Normalize `pass_configs` (enum keys -> strings), apply the public keys that map onto our passes,
    log the ones without effect on `target`, and refuse unknown keys."""
    out: dict[str, Any] = {}
    for k, v in (configs or {}).items():
        key = k.value if isinstance(k, PassConfigKey) else k
        if not isinstance(key, str):
            raise tilehal.ArgumentError(f"pass_configs: keys must be strings or tilelang.PassConfigKey, got {k!r}")
        if key not in _KNOWN and key not in OWN_KEYS:
            raise tilehal.ArgumentError(f"pass_configs: unknown key {key!r} (expected a tilelang.PassConfigKey value "
                                        f"or one of {sorted(OWN_KEYS)})")
        out[key] = v
    if target in ("cpu", "interp"):
        for key, v in out.items():
            if key in OWN_KEYS:
                continue
            if key in HONORED_ON_CPU:
                log.debug("pass_configs %s=%r on %s: %s", key, v, target, HONORED_ON_CPU[key] if v else "no change")
            else:
                log.info("pass_configs %s=%r has no effect on target %s", key, v, target)
        if out.get(PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS.value):
            out["disable_passes"] = [*out.get("disable_passes", ()), "guard_global_accesses",
                                    "check_local_accesses"]
        if out.get("tirx.disable_vectorize") or out.get("tir.disable_vectorize"):
            out["disable_passes"] = [*out.get("disable_passes", ()), "vectorize_hints"]
    return out
