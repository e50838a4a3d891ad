"""Compile-only (NVRTC sm_90a, no GPU): the FP4-weight kernel for every configuration the planner picks at
issue 19's decode shapes, plus the other template paths (gran 128, fp32 out + C, masked). Runs in CI."""

import pytest
import tilehal
from deepgemm import cuda_fp4

pytestmark = pytest.mark.skipif(tilehal.compiler_versions()["nvrtc"] is None, reason="NVRTC is not installed")


def configs():
    keys = set()
    for m in (1, 16, 64, 128):
        for n, k in ((7168, 2048), (2112, 7168), (4096, 7168)):
            for fp8 in (True, False):
                keys.add(cuda_fp4.plan(m, n, k, 1, fp8, True, False, False, num_sms=132).key)
    keys.add(cuda_fp4.plan(5, 200, 256, 1, True, False, True, False, num_sms=132).key)
    keys.add(cuda_fp4.plan(64, 2112, 2048, 4, True, True, False, True, num_sms=132, expected_m=16).key)
    return sorted(keys, key=lambda k: k.expression)


CONFIGS = configs()


def wgmma_configs():
    keys = set()
    for m in (1, 16, 64, 128):
        for n, k in ((7168, 2048), (2112, 7168), (4096, 7168)):
            keys.add(cuda_fp4.plan_wgmma(m, n, k, 1, True, False, False, num_sms=132).key)
    keys.add(cuda_fp4.plan_wgmma(37, 136, 1152, 1, False, True, False, num_sms=132).key)  # fp32 out + C
    keys.add(cuda_fp4.plan_wgmma(33, 2112, 2048, 1, True, False, False, num_sms=132).key)  # 64 tokens, 2 WGs
    for m in (1, 16, 64, 128):  # e4m3 activations (DEEPGEMM_FP4_KERNEL=wgmma)
        for n, k in ((7168, 2048), (2112, 7168), (4096, 7168)):
            keys.add(cuda_fp4.plan_wgmma(m, n, k, 1, True, False, False, num_sms=132, act_fp8=True).key)
    keys.add(cuda_fp4.plan_wgmma(37, 136, 1152, 1, False, True, False, num_sms=132, act_fp8=True).key)
    for fp8 in (True, False):  # grouped masked
        keys.add(cuda_fp4.plan_wgmma(64, 2112, 2048, 4, True, False, True, num_sms=132, expected_m=16, act_fp8=fp8).key)
    return sorted(keys, key=lambda k: k.expression)


WGMMA_CONFIGS = wgmma_configs()


@pytest.mark.parametrize("part", [0, 1, 2])
def test_fp4_wgmma_kernel_configs_compile(part, h):
    """The wgmma kernels: no spills and no serialized wgmma (ptxas C7510-C7515 warnings) at any planned config."""
    batch = WGMMA_CONFIGS[part::3]
    exprs = [k.expression for k in batch]
    mod = tilehal.compile_cuda(cuda_fp4.kernel_source(), arch="sm_90a", name="deepgemm_fp4_wgmma_compile_check",
                               options=cuda_fp4.OPTIONS + ("--ptxas-options=-v",), name_expressions=exprs)
    assert len(mod.cubin) > 1000
    h.check_compiled(mod, exprs, forbidden=("serialized",))


@pytest.mark.parametrize("half", [0, 1])
def test_fp4_kernel_configs_compile(half, h):
    batch = CONFIGS[half::2]
    exprs = [k.expression for k in batch]
    mod = tilehal.compile_cuda(cuda_fp4.kernel_source(), arch="sm_90a", name="deepgemm_fp4_compile_check",
                               options=cuda_fp4.OPTIONS + ("--ptxas-options=-v",), name_expressions=exprs)
    assert len(mod.cubin) > 1000
    h.check_compiled(mod, exprs, forbidden=())


def test_configs_cover_both_activation_kinds_and_token_tiles():
    assert {k.act_fp8 for k in CONFIGS} == {True, False}
    assert {k.nt for k in CONFIGS} >= {1, 2, 8} and any(k.masked for k in CONFIGS) and any(k.has_c for k in CONFIGS)


def test_wgmma_configs_cover_both_activation_kinds():
    assert {k.act_fp8 for k in WGMMA_CONFIGS} == {True, False}
    assert {k.nwg for k in WGMMA_CONFIGS} == {1, 2} and any(k.has_c for k in WGMMA_CONFIGS)
    assert {k.act_fp8 for k in WGMMA_CONFIGS if k.masked} == {True, False}
    assert max(k.nt for k in WGMMA_CONFIGS if k.act_fp8) <= cuda_fp4.WG_FP8_MAX_TOKEN_TILES
