"""The host fast path (deepgemm.plans) on the CPU: the GPU pieces are stood in for (a fake kernel that
records its launches, descriptors that carry their address in the first 8 bytes as CUtensorMaps do
for cuTensorMapReplaceAddress), so the replayed launch can be compared with the launch the full,
checked path makes for the same call."""

from __future__ import annotations

import hashlib
import struct

import deepgemm
import pytest
import torch
from deepgemm import cuda_gemm, plans, validate


def _gemm_module():
    """deepgemm.gemm the module (the package attribute `gemm` is the BLAS-style function)."""
    import importlib

    return importlib.import_module("deepgemm.gemm")


class FakeKernel:
    def __init__(self, log, key):
        self.log, self.key = log, key

    def launch(self, grid, block, args, smem_bytes=0, cluster=None):
        self.log.append((self.key, grid, block, list(args), smem_bytes, cluster))


def _fake_encode(ptr, dtype, shape, strides, box, swizzle="none"):
    rest = hashlib.sha256(repr((dtype, shape, strides, box, swizzle)).encode()).digest() * 4
    return struct.pack("<Q", ptr) + rest[:120]


@pytest.fixture
def fake_gpu(monkeypatch):
    launches, full_calls = [], []
    monkeypatch.setattr(validate, "same_device", lambda **k: torch.device("cuda"))
    monkeypatch.setattr(cuda_gemm, "_capability", lambda i: (9, 0))
    monkeypatch.setattr(cuda_gemm, "_kernel", lambda key: FakeKernel(launches, key))
    from deepgemm import splitk  # the split-K / tile kernel (bf16 C, MN-major operands, small M)

    monkeypatch.setattr(splitk, "_kernel", lambda key: FakeKernel(launches, key))
    monkeypatch.setattr(splitk, "encode_tiled", _fake_encode)
    splitk._DESC_CACHE.clear()
    monkeypatch.setattr(splitk, "_workspace", lambda dev, n, c: (torch.empty(n), torch.zeros(c, dtype=torch.int32)))
    monkeypatch.setattr(cuda_gemm, "encode_tiled", _fake_encode)
    monkeypatch.setattr(plans.tma, "retarget", lambda desc, p: struct.pack("<Q", p) + desc[8:])
    real_pick = cuda_gemm.pick_config

    def counting_pick(*a, **k):
        full_calls.append(a)
        return real_pick(*a, **k)

    monkeypatch.setattr(cuda_gemm, "pick_config", counting_pick)
    cuda_gemm._DESC_CACHE.clear()
    plans.clear()
    yield launches, full_calls
    plans.clear()
    cuda_gemm._DESC_CACHE.clear()


def _full_launch(call, full_calls):
    """The launch the full path makes for `call` (plans off; its heuristic call is not counted)."""
    n_calls = len(full_calls)
    saved = dict(plans._PLANS)
    plans.clear()
    log = []
    orig = cuda_gemm._kernel
    cuda_gemm._kernel = lambda key: FakeKernel(log, key)
    try:
        with plans.record(None, ()):
            call()
    finally:
        cuda_gemm._kernel = orig
        plans._PLANS.clear()
        plans._PLANS.update(saved)
        del full_calls[n_calls:]
    return log[-1]


def _same(l1, l2):
    assert l1[0] == l2[0] and l1[1:3] == l2[1:3] and l1[4:] == l2[4:]
    for x, y in zip(l1[3], l2[3]):
        assert (x is y) if isinstance(x, torch.Tensor) else (x == y)


def test_bf16_replay_equals_the_full_path(fake_gpu):
    launches, full_calls = fake_gpu
    m, n, k = 128, 512, 256
    for it in range(4):
        a = torch.randn(m, k).bfloat16()
        w = torch.randn(n, k).bfloat16()
        d = torch.empty(m, n, dtype=torch.bfloat16)
        deepgemm.bf16_gemm_nt(a, w, d)
        assert len(full_calls) == 1, "the heuristic ran again: the call did not replay its plan"
        _same(launches[-1], _full_launch(lambda a=a, w=w, d=d: deepgemm.bf16_gemm_nt(a, w, d), full_calls))
    assert len(launches) == 4


def test_fp8_replay_with_mn_major_scales(fake_gpu):
    launches, full_calls = fake_gpu
    m, n, k = 64, 256, 512
    for it in range(3):
        x = torch.randn(m, k)
        a, sfa = deepgemm.per_token_cast_to_fp8(x)
        sfa = deepgemm.get_mn_major_tma_aligned_tensor(sfa)
        b, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(n, k))
        d = torch.empty(m, n, dtype=torch.bfloat16)
        deepgemm.fp8_gemm_nt((a, sfa), (b, sfb), d)
        _same(launches[-1], _full_launch(lambda a=a, sfa=sfa, b=b, sfb=sfb, d=d: deepgemm.fp8_gemm_nt((a, sfa), (b, sfb), d),
                                         full_calls))
    assert len(full_calls) == 1


def test_no_plan_when_the_call_copies_an_operand(fake_gpu, monkeypatch):
    launches, full_calls = fake_gpu
    m, n, k = 64, 256, 512
    for _ in range(2):
        a, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(m, k))  # K-major sfa: transposed per call
        b, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(n, k))
        d = torch.empty(m, n, dtype=torch.bfloat16)
        deepgemm.fp8_gemm_nt((a, sfa), (b, sfb), d)
    assert len(full_calls) == 2 and not plans._PLANS
    c = torch.randn(m, n).bfloat16()
    a16, b16 = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    for _ in range(2):  # a bf16 C is not widened: at M <= C_TMA_MAX_M the C_TMA epilogue TMA-loads it
        deepgemm.bf16_gemm_nt(a16, b16, d, c)
    assert len(launches) == 4 and launches[-1][0].c_tma and launches[-1][0].has_c
    monkeypatch.setenv("DEEPGEMM_C_EPILOGUE", "staged")
    for _ in range(2):  # the staged epilogue reads it in place
        deepgemm.bf16_gemm_nt(a16, b16, d, c)
    assert len(launches) == 6 and launches[-1][0].c_bf16 and launches[-1][0].has_c
    c129, d129 = torch.randn(m, 129).bfloat16(), torch.empty(m, 129, dtype=torch.bfloat16)
    b129 = torch.randn(129, k).bfloat16()
    for _ in range(2):  # N % 8 != 0: the tile kernel reads the bf16 C in place; it has no plan (its workspace)
        deepgemm.bf16_gemm_nt(a16, b129, d129, c129)
    assert len(launches) == 8 and "splitk" in launches[-1][0].expression


def test_checks_still_run_for_a_new_signature_and_bad_alignment(fake_gpu):
    launches, full_calls = fake_gpu
    a = torch.randn(64, 256).bfloat16()
    w = torch.randn(128, 256).bfloat16()
    d = torch.empty(64, 128, dtype=torch.bfloat16)
    deepgemm.bf16_gemm_nt(a, w, d)
    with pytest.raises(deepgemm.ShapeError if hasattr(deepgemm, "ShapeError") else Exception, match="d: expected"):
        deepgemm.bf16_gemm_nt(a, w, torch.empty(64, 127, dtype=torch.bfloat16))
    buf = torch.empty(64 * 256 + 4, dtype=torch.bfloat16)
    a_off = buf[4:].view(64, 256)  # same signature, pointer 8 bytes off 16-byte alignment
    a_off.copy_(a)
    with pytest.raises(Exception, match="16-byte aligned"):
        deepgemm.bf16_gemm_nt(a_off, w, d)
    assert len(launches) == 1


def test_environment_switch_is_part_of_the_key(fake_gpu, monkeypatch):
    launches, full_calls = fake_gpu
    a = torch.randn(128, 256).bfloat16()
    w = torch.randn(512, 256).bfloat16()
    d = torch.empty(128, 512, dtype=torch.bfloat16)
    deepgemm.bf16_gemm_nt(a, w, d)
    tma_key = launches[-1][0]
    monkeypatch.setenv("DEEPGEMM_EPILOGUE", "direct")
    deepgemm.bf16_gemm_nt(a, w, d)
    assert len(full_calls) == 2 and launches[-1][0] != tma_key and not launches[-1][0].tma_store


def test_debug_checks_disable_plans(fake_gpu, monkeypatch):
    """DEEPGEMM_DEBUG=1 reads scale values on every call: every call takes the full path."""
    launches, full_calls = fake_gpu
    monkeypatch.setenv("DEEPGEMM_DEBUG", "1")
    a, w = torch.randn(64, 256).bfloat16(), torch.randn(128, 256).bfloat16()
    d = torch.empty(64, 128, dtype=torch.bfloat16)
    for _ in range(3):
        deepgemm.bf16_gemm_nt(a, w, d)
    assert len(full_calls) == 3 and not plans._PLANS


def test_aliased_operands_get_no_descriptor_plan(fake_gpu):
    launches, full_calls = fake_gpu
    x = torch.randn(128, 128).bfloat16()
    d = torch.empty(128, 128, dtype=torch.bfloat16)
    deepgemm.bf16_gemm_nt(x, x, d)  # a is b: the descriptor's owner is ambiguous
    deepgemm.bf16_gemm_nt(x, x, d)
    assert len(full_calls) == 2 and not plans._PLANS


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(128, 7168, 2048), (64, 1024, 4096), (4096, 4096, 4096), (77, 2112, 7168)])
def test_replayed_calls_are_exact_on_the_gpu(m, n, k):
    """Calls 2..4 of one signature run the replayed plan on fresh buffers (new descriptors through
    cuTensorMapReplaceAddress); each result must equal the full path's result for the same inputs."""
    from tilehal import calc_diff

    plans.clear()
    for it in range(4):
        a = torch.randn(m, k, device="cuda").bfloat16()
        w = torch.randn(n, k, device="cuda").bfloat16()
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        deepgemm.bf16_gemm_nt(a, w, d)
        full = torch.empty_like(d)
        _gemm_module()._bf16_gemm_checked(a, w, full, None, "nt", "nk")
        assert torch.equal(d, full), f"call {it}"
        assert calc_diff(d.double(), a.double() @ w.double().T) < 1e-5
        a8 = deepgemm.per_token_cast_to_fp8(a, tma_aligned_sf=True)
        w8 = deepgemm.per_block_cast_to_fp8(w)
        deepgemm.fp8_gemm_nt(a8, w8, d)
        _gemm_module()._fp8_gemm_checked(a8, w8, full, None, "nt", None, None, None, "nk", False)
        assert torch.equal(d, full), f"fp8 call {it}"
    # shapes on the split-K kernel (bf16 or fp8) have no plan (its workspace is not a caller tensor): full path
    from deepgemm import splitk

    sms = deepgemm.get_num_sms()
    assert len(plans._PLANS) == sum(splitk.pick_splitk(m, n, k, sms, kind) is None for kind in ("bf16", "fp8"))


def test_bias_on_the_cpu_reference():
    a, w = torch.randn(16, 256).bfloat16(), torch.randn(64, 256).bfloat16()
    bias = torch.randn(64)
    d = torch.empty(16, 64)
    deepgemm.bf16_gemm_nt(a, w, d, bias=bias)
    torch.testing.assert_close(d, a.float() @ w.float().T + bias, rtol=1e-5, atol=1e-4)
    with pytest.raises(Exception, match="bias: expected shape"):
        deepgemm.bf16_gemm_nt(a, w, d, bias=torch.randn(63))
    with pytest.raises(Exception, match="bias: expected dtype float32"):
        deepgemm.bf16_gemm_nt(a, w, d, bias=torch.randn(64).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(128, 7168, 2048), (4096, 4096, 4096), (77, 1000, 512)])
def test_bias_in_the_epilogue_on_the_gpu(m, n, k, monkeypatch):
    monkeypatch.setenv("DEEPGEMM_SPLITK", "0")  # the fp32 reference on the persistent kernel too (same K order)
    a = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda") * 10
    for fp8 in (False, True):
        d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ref32 = torch.empty(m, n, device="cuda", dtype=torch.float32)
        if fp8:
            a8, w8 = deepgemm.per_token_cast_to_fp8(a, tma_aligned_sf=True), deepgemm.per_block_cast_to_fp8(w)
            deepgemm.fp8_gemm_nt(a8, w8, d, bias=bias)
            deepgemm.fp8_gemm_nt(a8, w8, ref32)
        else:
            deepgemm.bf16_gemm_nt(a, w, d, bias=bias)
            deepgemm.bf16_gemm_nt(a, w, ref32)
        # the fp32 accumulator plus the bias, rounded once: within one bf16 ulp of rounding (acc + bias)
        # (the fp32-out kernel may tile differently; the accumulation order along K is the same)
        torch.testing.assert_close(d.float(), ref32 + bias, rtol=2**-7, atol=1e-3, msg=f"fp8={fp8}")
        assert (d == (ref32 + bias).bfloat16()).float().mean().item() > 0.999


def test_bf16_c_switch_sends_bf16_c_to_the_tile_kernel(fake_gpu, monkeypatch):
    """DEEPGEMM_BF16_C=tile (A/B timing): a bf16 C goes to the tile kernel as before the persistent kernel
    read it; by default the persistent kernel TMA-loads it (C_TMA), with DEEPGEMM_C_EPILOGUE=staged its staged
    epilogue reads it in place (C_BF16)."""
    launches, _ = fake_gpu
    m, n, k = 256, 512, 512
    a, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    c, d = torch.randn(m, n).bfloat16(), torch.empty(m, n, dtype=torch.bfloat16)
    deepgemm.bf16_gemm_nt(a, b, d, c)
    assert launches[-1][0].c_tma
    monkeypatch.setenv("DEEPGEMM_C_EPILOGUE", "staged")
    deepgemm.bf16_gemm_nt(a, b, d, c)
    assert launches[-1][0].c_bf16
    monkeypatch.setenv("DEEPGEMM_BF16_C", "tile")
    deepgemm.bf16_gemm_nt(a, b, d, c)
    assert "splitk" in launches[-1][0].expression


def test_mn_major_bf16_b_of_the_contiguous_grouped_gemm_is_taken(fake_gpu):
    """An MN-major bf16 B for m_grouped_bf16_gemm_nt_contiguous (DeepGEMM's SM90 bf16 grouped tests pass one)
    is copied K-major and launched, not refused."""
    launches, _ = fake_gpu
    g, n, k, rows = 2, 128, 256, 128
    a = torch.randn(g * rows, k).bfloat16()
    b = torch.randn(g, k, n).bfloat16().transpose(1, 2)  # [G, N, K] view, strides (K*N, 1, N)
    d = torch.empty(g * rows, n, dtype=torch.bfloat16)
    m_idx = torch.arange(g, dtype=torch.int32).repeat_interleave(rows)
    deepgemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_idx)
    assert launches and launches[-1][0].grouping == "contiguous"


@pytest.mark.parametrize("swiglu", [False, True])
def test_contiguous_grouped_replay_equals_the_full_path(fake_gpu, swiglu):
    """The grouped fp8 entry points (plain and SwiGLU epilogue) replay their launch like fp8_gemm_nt."""
    launches, full_calls = fake_gpu
    g, n, k = 3, 256, 512
    m_indices = torch.tensor([0] * 128 + [-1] * 128 + [2] * 128, dtype=torch.int32)
    m = m_indices.numel()
    fn = deepgemm.m_grouped_fp8_gemm_nt_contiguous_swiglu if swiglu else deepgemm.m_grouped_fp8_gemm_nt_contiguous
    for _ in range(3):
        a, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(m, k), tma_aligned_sf=True)
        b, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(g, n, k))
        d = torch.empty(m, n // 2 if swiglu else n, dtype=torch.bfloat16)
        fn((a, sfa), (b, sfb), d, m_indices)
        assert len(full_calls) == 1, "the heuristic ran again: the call did not replay its plan"
        assert launches[-1][0].swiglu == swiglu and launches[-1][0].grouping == "contiguous"
        _same(launches[-1], _full_launch(lambda a=a, sfa=sfa, b=b, sfb=sfb, d=d: fn((a, sfa), (b, sfb), d, m_indices),
                                         full_calls))
    assert len(launches) == 3


def test_contiguous_psum_layout_gets_no_plan(fake_gpu):
    """The psum layout's per-row indices are built per call: that launch argument is no operand, so no plan."""
    launches, full_calls = fake_gpu
    g, n, k = 2, 128, 256
    ends = torch.tensor([100, 256], dtype=torch.int32)
    for _ in range(2):
        a, sfa = deepgemm.per_token_cast_to_fp8(torch.randn(256, k), tma_aligned_sf=True)
        b, sfb = deepgemm.per_block_cast_to_fp8(torch.randn(g, n, k))
        d = torch.empty(256, n, dtype=torch.bfloat16)
        deepgemm.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, ends, use_psum_layout=True)
    assert len(full_calls) == 2 and len(launches) == 2 and not plans._PLANS


def test_c_tma_with_c_is_d_gets_a_plan_bound_to_d(fake_gpu, monkeypatch):
    """DEEPGEMM_C_EPILOGUE=tma with C = D: both TMA descriptors are built on D; C = D is in the key, so the plan
    binds them to D, and a call with a C of its own (same shapes) takes the full path: its C descriptor is C's."""
    launches, full_calls = fake_gpu
    monkeypatch.setenv("DEEPGEMM_C_EPILOGUE", "tma")
    a, w = torch.randn(128, 2048).bfloat16(), torch.randn(7168, 2048).bfloat16()
    d = torch.zeros(128, 7168, dtype=torch.bfloat16)
    deepgemm.bf16_gemm_nt(a, w, d, c=d)
    first = launches[-1]
    assert first[0].c_tma and len(full_calls) == 1
    d2 = torch.zeros_like(d)
    deepgemm.bf16_gemm_nt(a, w, d2, c=d2)  # replayed on new buffers
    assert len(full_calls) == 1
    _same(launches[-1], _full_launch(lambda: deepgemm.bf16_gemm_nt(a, w, d2, c=d2), full_calls))
    c = torch.zeros_like(d)
    deepgemm.bf16_gemm_nt(a, w, d, c=c)
    assert len(full_calls) == 2  # C = D was in the key: a separate C is another signature
    c_desc, d_desc = launches[-1][3][2], launches[-1][3][3]
    assert struct.unpack_from("<Q", c_desc)[0] == c.data_ptr() and struct.unpack_from("<Q", d_desc)[0] == d.data_ptr()


def test_env_key_reads_every_switch(monkeypatch):
    # env_key's fast path spells one lookup per _ENV_NAMES entry: a name added without its lookup would drop out
    for name in plans._ENV_NAMES:
        monkeypatch.setenv(name, "x")
    with pytest.raises(TypeError, match="DEEPGEMM_DEBUG"):  # DEEPGEMM_DEBUG set: no plan, the full path
        plans.env_key()
    monkeypatch.setenv("DEEPGEMM_DEBUG", "0")
    key = plans.env_key()
    assert len(key) == len(plans._ENV_NAMES) and sum(v in ("x", b"x") for v in key) == len(plans._ENV_NAMES) - 1
