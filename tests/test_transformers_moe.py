"""register_optimizations on the MoE blocks of transformers 5 (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3).

Tiny models built from configs (random weights, fixed seed, rounded to bf16 so both sides start from
the same values); the swapped block is compared with the transformers block itself in fp32.
Tolerance: ExpertParallelMoE rounds the expert activations to bf16 (unit roundoff 2^-8 with
round-to-nearest 2^-9) at four points (input, gate/up, SiLU*up, down output): the relative error
of the output is bounded by 2 * sqrt(4) * 2^-8 / sqrt(3) (~0.009), the bound test_moe.py uses.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tilestack import register_optimizations  # noqa: E402
from tilestack.moe import ExpertParallelMoE, grouped_sigmoid_topk, moe_block_parts  # noqa: E402

TOL_BF16 = 2 * math.sqrt(4) * 2.0**-8 / math.sqrt(3)
COMMON = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
              max_position_embeddings=64)


def _config(kind: str):
    if kind == "mixtral":
        return transformers.MixtralConfig(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, **COMMON)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=64, num_experts=8,
                                           num_experts_per_tok=2, shared_expert_intermediate_size=96,
                                           norm_topk_prob=False, decoder_sparse_step=1, **COMMON)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=64, num_experts=8,
                                           num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=1,
                                           head_dim=32, **COMMON)
    if kind == "deepseek_v3":
        c = dict(COMMON, num_key_value_heads=4)
        return transformers.DeepseekV3Config(intermediate_size=96, moe_intermediate_size=64, n_routed_experts=16,
                                             num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                                             routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                                             q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
                                             qk_nope_head_dim=16, v_head_dim=32, **c)
    raise AssertionError(kind)


def _model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = _config(kind)
    cls = {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM}[kind]
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p).mul_(p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1).bfloat16().float())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((torch.randn_like(b) * 0.05).bfloat16().float())
    return model


def _moe_layer(model) -> torch.nn.Module:
    return model.model.layers[-1].mlp


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]


@pytest.mark.parametrize("kind", KINDS)
def test_block_is_recognized_with_its_routing(kind):
    block = _moe_layer(_model(kind))
    parts = moe_block_parts(block)
    assert not isinstance(parts, str), parts
    assert parts.exact and parts.top_k == block.gate.top_k
    assert (parts.shared_expert is not None) == (kind in ("qwen2_moe", "deepseek_v3"))
    if kind == "deepseek_v3":
        assert parts.routing["scoring"] == "sigmoid" and parts.routing["n_group"] == 4
        assert parts.routing["routed_scaling_factor"] == 2.5


@pytest.mark.parametrize("kind", KINDS)
def test_swapped_block_matches_the_transformers_block(kind):
    model = _model(kind)
    block = _moe_layer(model)
    torch.manual_seed(1)
    x = torch.randn(3, 17, model.config.hidden_size).bfloat16().float()
    with torch.no_grad():
        want = block(x)
        _, w_ref, idx_ref = block.gate(x.reshape(-1, x.shape[-1]))
        moe = ExpertParallelMoE.from_module(block)
        idx, w = moe.route(x.reshape(-1, x.shape[-1]))
        got = moe(x)
    # Same experts, same weights (order of the k slots may differ: compare sorted by expert id).
    i_ref, o_ref = idx_ref.sort(dim=-1)
    i_got, o_got = idx.sort(dim=-1)
    assert torch.equal(i_ref, i_got)
    torch.testing.assert_close(w.gather(1, o_got), w_ref.float().gather(1, o_ref), rtol=1e-6, atol=1e-7)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < TOL_BF16


def test_grouped_sigmoid_routing_keeps_only_the_best_groups():
    torch.manual_seed(0)
    logits = torch.randn(64, 16)
    bias = torch.randn(16) * 0.1
    idx, w = grouped_sigmoid_topk(logits, 4, bias, n_group=4, topk_group=2, norm_topk_prob=True)
    choice = logits.sigmoid() + bias
    best = choice.view(64, 4, 4).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    assert all(set((idx[t] // 4).tolist()) <= set(best[t].tolist()) for t in range(64))
    torch.testing.assert_close(w.sum(-1), torch.ones(64))
    torch.testing.assert_close(w, logits.sigmoid().gather(1, idx) / logits.sigmoid().gather(1, idx).sum(-1, True))


@pytest.mark.parametrize("kind", KINDS)
def test_register_optimizations_swaps_the_blocks_of_a_whole_model(kind):
    model = _model(kind)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        report = register_optimizations(model, backend="cpu")
        got = model(ids).logits
    moe_layers = [n for n, _ in model.named_modules() if n.endswith(".mlp") and isinstance(_, ExpertParallelMoE)]
    assert report.names("swapped").count("model.layers.1.mlp") == 1 and "model.layers.1.mlp" in moe_layers
    assert not any(n.startswith("model.layers.1.mlp.experts") or n.startswith("model.layers.1.mlp.gate.")
                   for n in report.names("swapped") + report.names("skipped"))
    if kind == "qwen2_moe":     # the shared expert is kept, and its Linears are swapped on their own
        assert "model.layers.1.mlp.shared_expert.gate_proj" in report.names("swapped")
        assert "model.layers.1.mlp.shared_expert_gate" not in report.names("swapped")
    # Every Linear and expert now runs in bf16: the logits stay within a few bf16 roundings.
    assert rel_err(got, want) < 4 * TOL_BF16


def test_include_reports_every_named_module_that_is_not_swapped():
    model = _model("mixtral")
    report = register_optimizations(model, backend="cpu", include=["*mlp*", "*self_attn"])
    assert report.names("swapped") == ["model.layers.0.mlp", "model.layers.1.mlp"]
    skipped = dict((d.name, d.reason) for d in report.skipped)
    assert set(skipped) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert "not an MoE block" in skipped["model.layers.0.self_attn"]
    assert "Linears are considered one by one" in skipped["model.layers.0.self_attn"]
    assert "2 swapped, 2 skipped" in str(report)


def test_fp8_rule_skips_a_block_with_its_reason():
    model = _model("qwen3_moe")   # moe_intermediate_size 64: not a multiple of 128
    report = register_optimizations(model, backend="cpu", fp8=True, include=["*.mlp"])
    reasons = {d.name: d.reason for d in report.skipped}
    assert "fp8 grouped GEMMs need" in reasons["model.layers.0.mlp"]
    assert report.names("swapped") == []
