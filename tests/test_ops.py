"""tilestack.ops: the stack's operators as torch.library custom ops (CPU: the packages' references).

opcheck verifies each op's schema, fake (meta) implementation and autograd registration against its
real implementation; the compile tests run torch.compile(fullgraph=True) with the aot_eager backend
(dynamo capture + AOT tracing through the fake implementations; inductor's C++ build is left out to
keep the tests fast on CPU, the graphs are the same) and require outputs bit-equal to eager.
"""

from __future__ import annotations

import copy

import kvpool
import pytest
import torch

from tilestack import ops, register_optimizations
from tilestack.moe import ExpertParallelMoE, ReferenceMoE


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_bf16_gemm_matches_torch_and_passes_opcheck():
    a, b = _randn(40, 256, dtype=torch.bfloat16), _randn(72, 256, seed=1, dtype=torch.bfloat16)
    d = torch.ops.tilestack.bf16_gemm_nt(a, b, torch.float32)
    torch.testing.assert_close(d, a.float() @ b.float().T, rtol=1e-5, atol=1e-4)   # exact products, fp32 sums
    torch.library.opcheck(torch.ops.tilestack.bf16_gemm_nt.default, (a, b, torch.float32))


def test_bf16_gemm_backward_is_two_gemms():
    a = _randn(16, 128, dtype=torch.bfloat16).requires_grad_()
    b = _randn(32, 128, seed=1, dtype=torch.bfloat16).requires_grad_()
    g = _randn(16, 32, seed=2)
    torch.ops.tilestack.bf16_gemm_nt(a, b, torch.float32).backward(g)
    a2, b2 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    (a2 @ b2.T).backward(g)
    # The incoming gradient is rounded to bf16 for the GEMMs and the result to the operands' bf16:
    # two roundings of unit 2^-9, so normwise within 2 * 2 * 2^-9 = 2^-7.
    for got, want in ((a.grad, a2.grad), (b.grad, b2.grad)):
        assert float((got.float() - want).norm() / want.norm()) < 2**-7


def test_fp8_ops_pass_opcheck_and_refuse_autograd():
    x, w = _randn(8, 256), _randn(128, 256, seed=1)
    for op, args in ((torch.ops.tilestack.per_token_cast_to_fp8.default, (x,)),
                     (torch.ops.tilestack.per_block_cast_to_fp8.default, (w,))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    xa, wb = torch.ops.tilestack.per_token_cast_to_fp8(x), torch.ops.tilestack.per_block_cast_to_fp8(w)
    d = torch.ops.tilestack.fp8_gemm_nt(*xa, *wb, torch.float32)
    rel = float((d - x @ w.T).norm() / (x @ w.T).norm())
    assert d.shape == (8, 128) and rel < 0.144        # the fp8 bound of test_register_optimizations
    xg = x.clone().requires_grad_()
    y = torch.ops.tilestack.per_token_cast_to_fp8(xg)[1].sum()
    with pytest.raises(ops.AutogradUnsupportedError, match="per_token_cast_to_fp8 records no gradient"):
        y.backward()


def test_grouped_gemm_ops():
    e, n, k = 3, 64, 128
    a = _randn(256, k, dtype=torch.bfloat16)
    b = _randn(e, n, k, seed=1, dtype=torch.bfloat16)
    m_idx = torch.arange(256, dtype=torch.int32) // 128 % e   # two groups of 128 rows
    m_idx[200:] = -1
    d = torch.ops.tilestack.m_grouped_bf16_gemm_nt_contiguous(a, b, m_idx)
    want = torch.stack([a[i].float() @ b[m_idx[i]].float().T for i in range(200)])
    torch.testing.assert_close(d[:200].float(), want, rtol=2**-7, atol=1e-2)
    torch.library.opcheck(torch.ops.tilestack.m_grouped_bf16_gemm_nt_contiguous.default, (a, b, m_idx),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def _pool():
    pool = kvpool.KVPool(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=32, block_size=16,
                         dtype=torch.float32, device="cpu")
    for sid, n in (("a", 40), ("b", 70)):
        toks = list(range(n * 100, n * 101))         # distinct prompts: no shared prefix blocks
        assert pool.add_sequence(sid, toks) == 0
        slots = pool.append(sid, toks)
        pool.write(0, slots, _randn(n, 2, 64, seed=n), _randn(n, 2, 64, seed=n + 1))
    return pool, pool.block_table(["a", "b"]), pool.seq_lens(["a", "b"])


def test_kvpool_and_dataengine_ops_compile_in_one_graph():
    pool, bt, lens = _pool()
    q = _randn(2, 8, 64, seed=5)
    kmin, kmax = pool.key_summary(0)

    def step(q):
        sel = torch.ops.tilestack.select_blocks(q, kmin, kmax, bt, lens, 2, 1, 1, None)
        return ops.pool_decode(q, pool, 0, bt, lens, block_indices=sel)

    import dataengine

    want = kvpool.paged_decode(q, pool, 0, bt, lens,
                               block_indices=dataengine.select_blocks(q, kmin, kmax, bt, lens, 2, 1, 1))
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q)
    assert torch.equal(got, want)
    torch.library.opcheck(torch.ops.tilestack.paged_decode.default,
                          (q, pool.k_cache, pool.v_cache, bt, lens, None, ops.handle_of(pool), 0, None),
                          test_utils=("test_schema", "test_faketensor"))
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    qp = _randn(5, 8, 64, seed=6)
    torch.testing.assert_close(ops.pool_prefill(qp, pool, 0, bt, lens, cu),
                               kvpool.paged_prefill(qp, pool, 0, bt, lens, cu), rtol=0, atol=0)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(256, 256)
        self.moe = ReferenceMoE(256, 128, 8, 2)
        self.down = torch.nn.Linear(256, 128, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.moe(self.up(x))))


@pytest.mark.parametrize("fp8", [False, True])
def test_optimized_model_compiles_fullgraph_and_matches_eager(fp8):
    model = _Net().eval()
    report = register_optimizations(model, backend="cpu", fp8=fp8, include=["up", "moe", "down"])
    assert len(report.swapped) == 3
    x = _randn(3, 7, 256, seed=3)
    with torch.no_grad():
        want = model(x)
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, want)


def test_handles_follow_copies_and_die_with_their_object():
    lin = register_optimizations(torch.nn.Sequential(torch.nn.Linear(8, 8)), backend="cpu")
    assert lin.swapped
    moe = ExpertParallelMoE(128, 128, 4, 2)
    twin = copy.deepcopy(moe)
    assert twin._tilestack_handle != moe._tilestack_handle and ops.lookup(twin._tilestack_handle) is twin
    h = twin._tilestack_handle
    del twin
    import gc

    gc.collect()
    with pytest.raises(ops.TileStackError, match="its object is gone"):
        ops.lookup(h)


def test_gemm_linear_op_refuses_autograd_clearly():
    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    register_optimizations(model, backend="cpu")
    x = _randn(4, 128).requires_grad_()
    y = torch.ops.tilestack.gemm_linear(x, model[0].weight.detach(), None, model[0]._tilestack_handle)
    with pytest.raises(ops.AutogradUnsupportedError, match="gemm_linear records no gradient"):
        y.sum().backward()


def test_transformers_mixtral_compiles_fullgraph_after_register_optimizations():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=96, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.MixtralForCausalLM(cfg).eval()
    report = register_optimizations(model, backend="cpu")
    assert {"model.layers.0.mlp", "model.layers.1.mlp", "lm_head"} <= set(report.names("swapped"))
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    assert torch.equal(got, want)
