"""NVLink kernels: compile-only checks that run without a GPU (NVRTC), and the host-side layout."""

import ctypes

import pytest
from deepep.engines.nvlink import context, low_latency, normal

pytest.importorskip("cuda.bindings")


def _nvrtc_or_skip():
    import tilehal

    if not tilehal.compiler_versions().get("nvrtc"):
        pytest.skip("NVRTC is not available")


def test_kernels_compile_for_sm90a():
    _nvrtc_or_skip()
    mod = context.compile_kernels()
    assert mod.arch == "sm_90a" and len(mod.cubin) > 10_000
    for name in context.KERNEL_NAMES:
        assert name.encode() in mod.cubin


@pytest.mark.parametrize("struct, cname", [(normal.DispatchArgs, "DispatchArgs"), (normal.CombineArgs, "CombineArgs"),
                                           (low_latency.LLArgs, "LLArgs"), (normal.LayoutArgs, "LayoutArgs")])
def test_ctypes_mirror_matches_the_cuda_struct(struct, cname):
    """The kernels take their arguments as one struct: every field offset must agree with C++."""
    _nvrtc_or_skip()
    import tilehal

    checks = [f"static_assert(sizeof(deepep::{cname}) == {ctypes.sizeof(struct)}, \"size\");"]
    for field, _ in struct._fields_:
        off = getattr(struct, field).offset
        checks.append(f"static_assert(offsetof(deepep::{cname}, {field}) == {off}, \"{field}\");")
    src = context.kernel_source() + "\n".join(
        c.replace("offsetof(", "__builtin_offsetof(") for c in checks) + "\n"
    try:
        # a mismatch is a CompileError naming the field
        tilehal.compile_cuda(src, name=f"deepep_layout_{cname}", include_dirs=[context.KERNEL_DIR])
    except tilehal.CompileError as e:
        if "__builtin_offsetof" in str(e) and "undefined" in str(e):
            pytest.skip("this NVRTC lacks __builtin_offsetof (NVRTC 13.0); the layout is checked where it has it")
        raise


def test_num_nvl_bytes_sizes_the_regions():
    """Issue 18: num_nvl_bytes sizes the NVLink regions (a quarter per kind and parity); a call holds what
    fits, up to num_max_tokens_per_rank, and more tokens than that is a ShapeError naming num_nvl_bytes."""
    from types import SimpleNamespace

    from deepep.dispatcher import EngineOptions
    from deepep.engines.nvlink.memory import SharedRegion
    from tilehal import ShapeError

    def engine(nvl, cap=4096, ranks=2):
        return SimpleNamespace(num_ranks=ranks, cap=cap, options=EngineOptions(None, 1.0, ranks, cap, nvl))

    cap_of = normal.NvlinkDispatcher._capacity
    sig = 2 + 9 + 2 * 128
    assert cap_of(engine(0), "dispatch", sig, 1152, 10) == (4096, 2 * 4096 * 1152)  # unset: from the token cap
    nvl = 64 << 20
    cap, data = cap_of(engine(nvl), "dispatch", sig, 1152, 4096)
    assert cap == 4096 and SharedRegion.parity_size(sig, data) == nvl // 4  # the quarter, to the byte
    cap, data = cap_of(engine(8 << 20), "dispatch", sig, 1152, 10)
    assert cap == (2 * 2**20 - 4096) // (2 * 1152) == 908 and SharedRegion.parity_size(sig, data) == 2 << 20
    with pytest.raises(ShapeError, match=r"x: expected at most 908 tokens per rank .*num_nvl_bytes=8388608"):
        cap_of(engine(8 << 20), "dispatch", sig, 1152, 909)
    with pytest.raises(ShapeError, match="num_max_tokens_per_rank=4096"):
        cap_of(engine(0), "dispatch", sig, 1152, 4097)
