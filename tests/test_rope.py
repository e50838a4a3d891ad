"""Fused RoPE (tilestack.rope): q and k rotated in place by one CUDA kernel inside transformers' attention blocks.

CPU: the kernel compiles for sm_90a (NVRTC, no GPU needed); each class in ROPE_ATTENTION_CLASSES, rewritten, gives
its own forward's outputs bit for bit (eager and SDPA attention, a DynamicCache, sliding windows), state_dict keys
unchanged; the launch arguments drive a Python mirror of the kernel's indexing to the reference rotation (row
strides of grouped projections, one cos row set for the batch). GPU: the kernel equals transformers'
apply_rotary_pos_emb bit for bit, in models too.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from tilestack.rope import (
    ROPE_ATTENTION_CLASSES,
    FusedRoPEMixin,
    compile_module,
    rope_in_place,
    rope_reference,
    rope_skip_reason,
    why_not_fused,
)

transformers = pytest.importorskip("transformers")

_CONFIGS = {"LlamaAttention": ("llama", "LlamaConfig", "LlamaForCausalLM", {}),
            "MistralAttention": ("mistral", "MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
            "Qwen2Attention": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
                               {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1})}


def _model(cls_name: str, dtype=torch.float32, device="cpu", attn="sdpa"):
    mod, cfg_name, model_name, extra = _CONFIGS[cls_name]
    m = importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
    cfg = getattr(transformers, cfg_name)(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                          attn_implementation=attn, **extra)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(m, model_name)(cfg).to(dtype).eval()
    return model


def test_kernel_compiles_for_sm90a():
    assert compile_module() is not None


def test_every_listed_class_has_a_config():
    assert set(ROPE_ATTENTION_CLASSES) == set(_CONFIGS)


@pytest.mark.parametrize("cls_name", sorted(_CONFIGS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_rewritten_block_gives_its_own_forward(cls_name, attn):
    from tilestack import register_optimizations

    model = _model(cls_name, attn=attn)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    rep = register_optimizations(model, backend="cpu", fuse_norm=False, fuse_rope=True, include=["*self_attn"])
    blocks = [d for d in rep.swapped if d.kind == "attention"]
    assert [d.name for d in blocks] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    attn0 = model.model.layers[0].self_attn
    assert isinstance(attn0, FusedRoPEMixin) and type(attn0).__name__ == f"FusedRoPE{cls_name}"
    assert isinstance(attn0, type(ref.model.layers[0].self_attn))
    assert list(model.state_dict()) == keys
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        # a cache across calls (prefill, then one token): the cache path of the rewritten forward
        c1, c2 = transformers.DynamicCache(config=model.config), transformers.DynamicCache(config=ref.config)
        a, b = model(ids, cache=c1, use_cache=True), ref(ids, cache=c2, use_cache=True)
        nxt = a.logits[:, -1:].argmax(-1)
        assert torch.equal(model(nxt, cache=c1, use_cache=True).logits,
                           ref(nxt, cache=c2, use_cache=True).logits)
        assert torch.equal(a.logits, b.logits)


def test_generate_matches_and_linears_still_swap():
    from tilestack import register_optimizations
    from tilestack.layers import GemmLinear

    model = _model("LlamaAttention")
    ref = copy.deepcopy(model)
    rep = register_optimizations(model, backend="cpu", fuse_norm=False, fuse_rope=True)
    assert isinstance(model.model.layers[1].self_attn.q_proj, GemmLinear)   # the block's children swapped too
    assert "model.layers.1.self_attn" in rep.names()
    ids = torch.randint(0, 96, (2, 5))
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
        want = ref.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_compiles_fullgraph_with_the_torch_formula():
    from tilestack import register_optimizations

    model = _model("Qwen2Attention")
    register_optimizations(model, backend="cpu", fuse_rope=True)
    ids = torch.randint(0, 96, (2, 6))
    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    assert torch.equal(got, want)


def test_default_is_on_for_cuda_only(monkeypatch):
    import tilestack.optimize as opt

    model = _model("LlamaAttention")
    rep = opt.register_optimizations(copy.deepcopy(model), backend="cpu")
    assert not [d for d in rep.swapped if d.kind == "attention"]
    monkeypatch.setattr(opt, "_cuda_unavailable_reason", lambda: None)
    rep = opt.register_optimizations(copy.deepcopy(model), backend="cuda", include=["*self_attn"])
    assert [d.kind for d in rep.swapped] == ["attention", "attention"]
    with pytest.raises(Exception, match="fuse_rope"):
        opt.register_optimizations(copy.deepcopy(model), backend="cpu", fuse_rope="yes")


def test_skip_reasons():
    assert rope_skip_reason(torch.nn.Linear(4, 4)) is not None
    model = _model("LlamaAttention")
    assert rope_skip_reason(model.model.layers[0].self_attn) is None
    q, k, cs = torch.zeros(1, 2, 64), torch.zeros(1, 2, 32), torch.zeros(1, 2, 16)
    assert "CUDA" in why_not_fused(q, k, cs, cs, 16)


def _mirror(calls):
    """A Python mirror of rope_bf16: each launch's arguments, read as the kernel reads them, applied with torch."""
    class Stub:
        def launch(self, grid, block, args):
            q, k, cos, sin, tokens, seq, hq, hk, d, ldq, ldk, cs_b = args
            tokens, ldq, ldk, cs_b = (a.obj.value for a in (tokens, ldq, ldk, cs_b))
            calls.append((grid, block, tokens, seq, hq, hk, d, ldq, ldk, cs_b))
            assert grid * block >= tokens * (hq + hk) * (d // 16)
            for x, heads, ld in ((q, hq, ldq), (k, hk, ldk)):
                rows = torch.as_strided(x, (tokens, heads, d), (ld, d, 1), x.storage_offset())
                cs = [torch.as_strided(c, (tokens, d), (1, 1), c.storage_offset()).clone() for c in (cos, sin)]
                for t in range(tokens):
                    off = cs_b * (t // seq) + d * (t % seq)
                    for j, c in enumerate((cos, sin)):
                        cs[j][t] = torch.as_strided(c, (d,), (1,), c.storage_offset() + off)
                h = d // 2
                x1, x2 = rows[..., :h].clone(), rows[..., h:].clone()
                c, s = cs[0][:, None], cs[1][:, None]
                rows[..., :h] = (x1 * c[..., :h]) + (-x2 * s[..., :h])
                rows[..., h:] = (x2 * c[..., h:]) + (x1 * s[..., h:])
    return Stub()


@pytest.mark.parametrize("batch_cos", [True, False])
def test_launch_arguments_drive_the_reference_rotation(monkeypatch, batch_cos):
    """The host side of rope_in_place without a GPU: q and k as slices of one grouped projection output (row stride
    = the concatenated width), cos / sin per sequence or one set for the batch (stride 0)."""
    import tilestack.rope as rp

    calls = []
    monkeypatch.setattr(rp, "_kernel", lambda: _mirror(calls))
    torch.manual_seed(1)
    b, s, hq, hk, d = 2, 3, 4, 2, 32
    qkv = torch.randn(b, s, (hq + 2 * hk) * d).bfloat16()
    q, k = qkv[..., :hq * d], qkv[..., hq * d:(hq + hk) * d]
    cos, sin = torch.randn(b if batch_cos else 1, s, d).bfloat16(), torch.randn(b if batch_cos else 1, s, d).bfloat16()
    want_q, want_k = rope_reference(q.view(b, s, hq, d).transpose(1, 2), k.view(b, s, hk, d).transpose(1, 2), cos, sin)
    v_before = qkv[..., (hq + hk) * d:].clone()
    rope_in_place(q, k, cos, sin, d)
    (grid, block, tokens, seq, *_rest, ldq, ldk, cs_b), = calls
    assert (tokens, seq, ldq, ldk, cs_b) == (b * s, s, qkv.shape[-1], qkv.shape[-1], s * d if batch_cos else 0)
    assert torch.equal(q.view(b, s, hq, d).transpose(1, 2), want_q)
    assert torch.equal(k.view(b, s, hk, d).transpose(1, 2), want_k)
    assert torch.equal(qkv[..., (hq + hk) * d:], v_before)     # v untouched


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("b,s,hq,hk,d,grouped,batch_cos", [(8, 512, 32, 8, 128, False, False),
                                                          (3, 7, 4, 2, 64, True, True), (1, 1, 32, 8, 128, True, False),
                                                          (64, 1, 32, 8, 128, False, True), (2, 5, 6, 6, 16, False, True)])
def test_kernel_matches_apply_rotary_pos_emb(b, s, hq, hk, d, grouped, batch_cos):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    n = (hq + 2 * hk) * d if grouped else hq * d
    out = torch.randn(b, s, n, device="cuda").bfloat16()
    q = out[..., :hq * d]
    k = out[..., hq * d:(hq + hk) * d] if grouped else torch.randn(b, s, hk * d, device="cuda").bfloat16()
    pos = torch.arange(s, device="cuda").float()[None, :, None] + (torch.arange(b, device="cuda")[:, None, None]
                                                                     if batch_cos else 0)
    freqs = pos * (10000.0 ** (-torch.arange(0, d // 2, device="cuda").float() / (d // 2)))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    want_q, want_k = apply_rotary_pos_emb(q.view(b, s, hq, d).transpose(1, 2), k.view(b, s, hk, d).transpose(1, 2),
                                          cos, sin)
    assert why_not_fused(q, k, cos, sin, d) is None
    rope_in_place(q, k, cos, sin, d)
    torch.cuda.synchronize()
    assert torch.equal(q.view(b, s, hq, d).transpose(1, 2), want_q)
    assert torch.equal(k.view(b, s, hk, d).transpose(1, 2), want_k)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("cls_name", sorted(_CONFIGS))
def test_model_logits_bitwise_on_gpu(cls_name):
    from tilestack import register_optimizations

    model = _model(cls_name, dtype=torch.bfloat16, device="cuda")
    ref = copy.deepcopy(model)
    register_optimizations(model, fuse_norm=False, fuse_rope=True, include=["*self_attn"])
    ids = torch.randint(0, 96, (4, 33), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False),
                           ref.generate(ids, max_new_tokens=3, do_sample=False))
