"""Compile-only (NVRTC sm_90a, no GPU): the FP4-weight kernels (mma.sync, wgmma, streaming) for every
configuration the planners pick at issue 19's decode shapes, plus the other template paths (gran 128, fp32 out
+ C, masked). Runs in CI."""

import itertools

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


def stream_configs():
    keys = set()
    for m in (1, 5, 16, 32, 64):
        for n, k in ((7168, 2048), (2112, 7168), (4096, 7168)):
            keys.add(cuda_fp4.plan_stream(m, n, k, 1, True, False, False, num_sms=132).key)
    keys.add(cuda_fp4.plan_stream(1, 136, 128 * 8 * 25, 1, True, False, False, num_sms=132).key)  # whole range: ring
    keys.add(cuda_fp4.plan_stream(16, 2112, 7168, 1, False, True, False, num_sms=132).key)  # fp32 out + C
    keys.add(cuda_fp4.plan_stream(64, 2112, 2048, 4, True, False, True, num_sms=132, expected_m=16).key)  # masked
    return sorted(keys, key=lambda k: k.expression)


STREAM_CONFIGS = stream_configs()

# ((RW, splits, P, PF, CTAs per SM) forced, token counts): the GPU round's variants (gpu_job.sh: DEEPGEMM_FP4_SMALL_*);
# one slot at 32 warps per SM at M = 1 only (at 16 tokens it spills)
SMALL_VARIANTS = [((None, None, None, 256, None), (1, 16)), ((None, None, 4, None, 2), (1, 16)),
                  ((None, None, 1, None, 4), (1,)), ((1, None, None, None, None), (1, 16))]


def small_configs():
    keys = set()
    for m in (1, 5, 16, 32, 64, 128):
        for n, k in ((7168, 2048), (2112, 7168), (4096, 7168)):
            keys.add(cuda_fp4.plan_small(m, n, k, 1, True, False, False, num_sms=132).key)
    keys.add(cuda_fp4.plan_small(2, 136, 16384, 1, True, False, False, num_sms=132).key)  # 1 row warp x 8 k-warps
    keys.add(cuda_fp4.plan_small(16, 2112, 7168, 1, False, True, False, num_sms=132).key)  # fp32 out + C
    keys.add(cuda_fp4.plan_small(64, 2112, 2048, 4, True, False, True, num_sms=132, expected_m=16).key)  # masked
    for forced, ms in SMALL_VARIANTS:  # the bench's A/B variants at M = 1 / 16 (DEEPGEMM_FP4_SMALL_*)
        for m, (n, k) in itertools.product(ms, ((7168, 2048), (2112, 7168), (4096, 7168))):
            keys.add(cuda_fp4._plan_small(m, n, k, 1, True, False, False, 132, None, 8, forced).key)
    return sorted(keys, key=lambda k: k.expression)


SMALL_CONFIGS = small_configs()


def small_fit_configs():
    """DEEPGEMM_FP4_SMALL_FIT=driver compiles every candidate of a shape to ask the driver about it: those of the
    12 issue rows (bf16 and fp32 out) that the model planner's set above lacks."""
    keys = set()
    for m, (n, k), out_bf16 in itertools.product((1, 16, 64, 128), ((7168, 2048), (2112, 7168), (4096, 7168)),
                                                 (True, False)):
        keys |= cuda_fp4.small_candidate_keys(m, n, k, 1, out_bf16, False, False)
    return sorted(keys - set(SMALL_CONFIGS), key=lambda k: k.expression)


SMALL_FIT_CONFIGS = small_fit_configs()

# (kind, batch): every kernel family's planned configurations in a few NVRTC runs; the wgmma kernels must not
# serialize their wgmmas (ptxas C7510-C7515 warnings); nothing may spill (h.check_compiled).
BATCHES = ([("mma", CONFIGS[i::2], ()) for i in range(2)] + [("wgmma", WGMMA_CONFIGS[i::3], ("serialized",))
                                                               for i in range(3)]
           + [("stream", STREAM_CONFIGS, ())] + [("small", SMALL_CONFIGS[i::2], ()) for i in range(2)]
           + [("small_fit", SMALL_FIT_CONFIGS[i::2], ()) for i in range(2)])


@pytest.mark.parametrize("kind,batch,forbidden", BATCHES, ids=[f"{k}{i}" for i, (k, _, _) in enumerate(BATCHES)])
def test_fp4_kernel_configs_compile(kind, batch, forbidden, h):
    exprs = [k.expression for k in batch]
    mod = tilehal.compile_cuda(cuda_fp4.kernel_source(), arch="sm_90a", name=f"deepgemm_fp4_{kind}_compile_check",
                               options=cuda_fp4.OPTIONS + ("--ptxas-options=-v",), name_expressions=exprs)
    assert len(mod.cubin) > 1000
    h.check_compiled(mod, exprs, forbidden=forbidden)


def test_configs_cover_both_activation_kinds_and_token_tiles():
    assert {k.act_fp8 for k in CONFIGS} == {True, False}
    assert {k.nt for k in CONFIGS} >= {1, 2, 8} and any(k.masked for k in CONFIGS) and any(k.has_c for k in CONFIGS)


def test_stream_configs_cover_both_token_tiles_c_and_masked():
    assert {k.nt for k in STREAM_CONFIGS} == {1, 2, 4, 8} and any(k.has_c for k in STREAM_CONFIGS)
    assert {(k.nt, k.ring) for k in STREAM_CONFIGS} >= {(1, False), (1, True), (2, False), (8, True)}
    assert any(k.masked for k in STREAM_CONFIGS) and {k.out_bf16 for k in STREAM_CONFIGS} == {True, False}


def test_wgmma_configs_cover_both_activation_kinds():
    assert {k.act_fp8 for k in WGMMA_CONFIGS} == {True, False}
    assert {k.nwg for k in WGMMA_CONFIGS} == {1, 2} and any(k.has_c for k in WGMMA_CONFIGS)
    assert {k.act_fp8 for k in WGMMA_CONFIGS if k.masked} == {True, False}
    assert max(k.nt for k in WGMMA_CONFIGS if k.act_fp8) <= cuda_fp4.WG_FP8_MAX_TOKEN_TILES


def test_small_configs_cover_token_tiles_warp_shapes_c_and_masked():
    assert {k.nt for k in SMALL_CONFIGS} == {1, 2, 4, 8} and {k.kw for k in SMALL_CONFIGS} >= {1, 2, 8}
    assert any(k.has_c for k in SMALL_CONFIGS) and any(k.masked for k in SMALL_CONFIGS)
    assert {k.out_bf16 for k in SMALL_CONFIGS} == {True, False} and {k.pf for k in SMALL_CONFIGS} == {0, 256}
