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
