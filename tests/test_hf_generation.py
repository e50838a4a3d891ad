"""tilestack.hf: transformers models generating on kvpool, checked against transformers' own cache.

Models are built from tiny configs with a fixed seed (random weights: no downloads). The oracle is
the same model with transformers' default cache (DynamicCache) and SDPA attention, greedy, fp32.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
th = pytest.importorskip("tilestack.hf")

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 128
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
}


def tiny(arch="llama", seed=0, dtype=torch.float32, device="cpu", **over):
    cfg_cls, model_cls, extra = ARCHS[arch]
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0, eos_token_id=None,
              bos_token_id=None)
    kw.update(extra)
    kw.update(over)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def prompts(lens, seed=1, pad_left=True):
    """Left-padded batch [B, max(lens)] with its attention mask (token ids avoid the pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    S = max(lens)
    ids = torch.zeros(len(lens), S, dtype=torch.long)
    mask = torch.zeros(len(lens), S, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, S - n:] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[b, S - n:] = 1
    return ids, mask


def greedy(model, ids, mask, n=6, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_dense_kvpool_equals_transformers_default(arch):
    model = tiny(arch)
    ids, mask = prompts([37, 20, 5])  # left padding, a partial last block, a sequence under one block
    ref_tok, ref_logits = greedy(model, ids, mask)
    cache = th.enable_kvpool(model, num_blocks=32, block_size=8)
    tok, logits = greedy(model, ids, mask, **th.cache_kwargs(model, cache))
    assert torch.equal(tok, ref_tok)
    assert (logits - ref_logits).abs().max().item() < 1e-4
    cache.pool.check_invariants()
    s = cache.stats()
    assert s["sequences"] == 3 and s["decode_steps"] == 5 and s["attended_fraction"] == 1.0
    th.disable_kvpool(model)
    assert torch.equal(greedy(model, ids, mask)[0], ref_tok)


def test_past_key_values_keyword_and_forward_loop():
    model = tiny("llama")
    ids, mask = prompts([24, 24])
    ref_tok, _ = greedy(model, ids, mask, n=4)
    cache = th.enable_kvpool(model, num_blocks=16, block_size=16)
    with pytest.warns(FutureWarning):  # transformers 5.24 renames it `cache`; both reach the same cache
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert torch.equal(out[:, ids.shape[1]:], ref_tok)
    # A hand-written loop: new_request registers the prompts, each forward appends to the pool.
    start = cache.new_request(ids, mask)
    assert start == 16  # the first request's full block is shared (the last prompt token is never cached)
    x, toks = ids[:, start:], []
    for _ in range(4):
        logits = model(x, **th.cache_kwargs(model, cache)).logits[:, -1]
        x = logits.argmax(-1, keepdim=True)
        toks.append(x)
    assert torch.equal(torch.cat(toks, 1), ref_tok)


def test_sparse_with_every_block_equals_dense_and_small_budget_attends_less():
    model = tiny("llama")
    ids, mask = prompts([70, 41])
    cache = th.enable_kvpool(model, num_blocks=64, block_size=8)
    dense_tok, dense_logits = greedy(model, ids, mask, n=8, **th.cache_kwargs(model, cache))
    cache = th.enable_kvpool(model, num_blocks=64, block_size=8, sparse=th.SparseConfig(top_k=64))
    tok, logits = greedy(model, ids, mask, n=8, **th.cache_kwargs(model, cache))
    assert torch.equal(tok, dense_tok)
    assert (logits - dense_logits).abs().max().item() < 1e-5
    assert cache.stats()["attended_fraction"] == 1.0
    cache = th.enable_kvpool(model, num_blocks=64, block_size=8, sparse=th.SparseConfig(top_k=3))
    greedy(model, ids, mask, n=8, **th.cache_kwargs(model, cache))
    s = cache.stats()
    assert s["sparse_decode_steps"] == 7 and 0 < s["attended_fraction"] < 0.5
    cache.pool.check_invariants()


def test_sparse_on_fp8_summaries_with_every_block_equals_dense():
    model = tiny("llama")
    ids, mask = prompts([70, 41])
    dense_tok, dense_logits = greedy(model, ids, mask, n=8, cache=th.enable_kvpool(model, num_blocks=64, block_size=8))
    cfg = th.SparseConfig(top_k=64, summary_dtype=torch.float8_e4m3fn)
    cache = th.enable_kvpool(model, num_blocks=64, block_size=8, sparse=cfg)
    assert cache.pool.key_summary(0)[0].dtype == torch.float8_e4m3fn
    tok, logits = greedy(model, ids, mask, n=8, **th.cache_kwargs(model, cache))
    assert torch.equal(tok, dense_tok) and (logits - dense_logits).abs().max().item() < 1e-5
    cache = th.enable_kvpool(model, num_blocks=64, block_size=8, sparse=th.SparseConfig(3, summary_dtype=cfg.summary_dtype))
    greedy(model, ids, mask, n=8, **th.cache_kwargs(model, cache))
    assert 0 < cache.stats()["attended_fraction"] < 0.5
    cache.pool.check_invariants()
    with pytest.raises(ValueError, match="summary_dtype"):
        th.SparseConfig(4, summary_dtype=torch.float16)


def test_prefix_cached_second_request_equals_cold_and_skips_the_prefix():
    model = tiny("qwen2")
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, VOCAB, (1, 96), generator=g)
    first = torch.cat([prefix, torch.randint(1, VOCAB, (1, 7), generator=g)], 1)
    second = torch.cat([prefix, torch.randint(1, VOCAB, (1, 12), generator=g)], 1)
    cold_tok, cold_logits = greedy(model, second, torch.ones_like(second))
    cache = th.enable_kvpool(model, num_blocks=64, block_size=16)
    greedy(model, first, torch.ones_like(first), **th.cache_kwargs(model, cache))
    before = cache.stats()
    tok, logits = greedy(model, second, torch.ones_like(second), **th.cache_kwargs(model, cache))
    after = cache.stats()
    assert torch.equal(tok, cold_tok)
    assert (logits - cold_logits).abs().max().item() < 1e-4
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == 96
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == 12  # the prefix was not prefilled
    cache.pool.check_invariants()


def test_batched_rows_with_different_hits_and_padding():
    model = tiny("mistral")
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(1, VOCAB, (40,), generator=g)
    rows = [torch.cat([prefix, torch.randint(1, VOCAB, (5,), generator=g)]),  # hits its 5 full blocks (40 tokens)
            torch.cat([prefix[:20], torch.randint(1, VOCAB, (3,), generator=g)]),  # hits 16
            torch.randint(1, VOCAB, (30,), generator=g)]  # hits nothing, left padded
    S = max(len(r) for r in rows)
    ids = torch.zeros(3, S, dtype=torch.long)
    mask = torch.zeros(3, S, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, S - len(r):], mask[b, S - len(r):] = r, 1
    ref_tok, ref_logits = greedy(model, ids, mask, n=5)
    cache = th.enable_kvpool(model, num_blocks=64, block_size=8)
    greedy(model, prefix[None], torch.ones(1, 40, dtype=torch.long), n=2, **th.cache_kwargs(model, cache))
    tok, logits = greedy(model, ids, mask, n=5, **th.cache_kwargs(model, cache))
    assert torch.equal(tok, ref_tok)
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert cache.stats()["prompt_tokens_cached"] == 40 + 16
    cache.pool.check_invariants()


def test_parallel_sampling_forks_share_the_prompt():
    model = tiny("llama")
    ids, mask = prompts([45])
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=3, top_k=0)
    torch.manual_seed(123)
    ref = model.generate(ids, **kw)
    cache = th.enable_kvpool(model, num_blocks=32, block_size=8)
    torch.manual_seed(123)
    out = model.generate(ids, **th.cache_kwargs(model, cache), **kw)
    assert torch.equal(out, ref)
    s = cache.stats()
    assert s["forks"] == 2 and s["cow_copies"] >= 2  # the shared partial block was copied on the first append
    # 3 sequences of 50 tokens (7 blocks each unshared) hold 5 shared prompt blocks + 3 x 2 own.
    assert s["blocks_used"] == 5 + 3 * 2
    cache.pool.check_invariants()


def test_beam_search_reorders_through_forks():
    model = tiny("llama")
    ids, mask = prompts([30, 18])
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, num_beams=3)
    ref = model.generate(ids, **kw)
    cache = th.enable_kvpool(model, num_blocks=64, block_size=8)
    out = model.generate(ids, **th.cache_kwargs(model, cache), **kw)
    assert torch.equal(out, ref)
    cache.pool.check_invariants()


def test_unsupported_architecture_is_refused_by_name():
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    with pytest.raises(th.UnsupportedModelError, match="model_type 'gpt2'"):
        th.enable_kvpool(GPT2LMHeadModel(cfg), num_blocks=8)


def test_pool_exhausted_mid_generation_keeps_the_pool_consistent():
    model = tiny("llama")
    ids, mask = prompts([30, 30])
    cache = th.enable_kvpool(model, num_blocks=9, block_size=8)  # prompts: 2 x 4 blocks; the 9th lasts 2 rows x 2
    with pytest.raises(th.PoolExhaustedError, match="exhausted"):
        model.generate(ids, attention_mask=mask, **th.cache_kwargs(model, cache), max_new_tokens=20, do_sample=False)
    pool = cache.pool
    pool.check_invariants()
    lens = [pool.num_tokens(s) for s in cache.seq_ids]
    assert len(lens) == 2 and all(n >= 32 for n in lens)  # nothing the batch holds was freed
    assert pool.stats().blocks_free == 0 or min(lens) % 8 == 0
    cache.reset()
    pool.check_invariants()
    assert pool.stats().blocks_used == 0 and pool.stats().blocks_cached > 0  # the prompts stay matchable


def test_sequence_longer_than_the_pool_or_window():
    model = tiny("llama")
    ids, mask = prompts([70])
    cache = th.enable_kvpool(model, num_blocks=4, block_size=16)
    with pytest.raises(th.SequenceTooLongError, match="the pool holds 64 tokens"):
        model.generate(ids, attention_mask=mask, **th.cache_kwargs(model, cache), max_new_tokens=2)
    assert len(cache.pool) == 0
    cache.pool.check_invariants()
    ids, mask = prompts([60])
    with pytest.raises(th.SequenceTooLongError, match="row 0: 65 tokens"):
        model.generate(ids, attention_mask=mask, **th.cache_kwargs(model, cache), max_new_tokens=8)
    cache.pool.check_invariants()
    assert cache.pool.num_tokens(cache.seq_ids[0]) == 64
    windowed = tiny("mistral", sliding_window=32)
    cache = th.enable_kvpool(windowed, num_blocks=16, block_size=8)
    ids, mask = prompts([30])
    with pytest.raises(th.SequenceTooLongError, match="attention window is 32"):
        windowed.generate(ids, attention_mask=mask, **th.cache_kwargs(windowed, cache), max_new_tokens=8)


def test_another_cache_on_a_kvpool_model_is_refused():
    model = tiny("llama")
    ids, mask = prompts([10])
    th.enable_kvpool(model, num_blocks=8)
    with pytest.raises(th.CacheMismatchError, match="pass the cache enable_kvpool returned"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2)
    th.disable_kvpool(model)
    assert model.config._attn_implementation == "sdpa"
    model.generate(ids, attention_mask=mask, max_new_tokens=2)


@pytest.mark.gpu
def test_gpu_bf16_kvpool_matches_transformers_within_tolerance():
    """bf16 on CUDA: kvpool dense / sparse-with-every-block / prefix-cached vs transformers' default (SDPA).

    Teacher-forced on transformers' greedy tokens so every step compares the same inputs:
    logits within 0.05 absolute (bf16 rounding of a 2-layer random model whose logits are O(1)).
    """
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = tiny("llama", dtype=torch.bfloat16, device="cuda", hidden_size=512, intermediate_size=1024,
                 num_attention_heads=8, num_key_value_heads=2)  # head_dim 64, 4 q heads per kv head: the kernel's
    ids, mask = prompts([300, 181])
    ids, mask = ids.cuda(), mask.cuda()
    ref_tok, ref_logits = greedy(model, ids, mask, n=8)
    forced = torch.cat([ids, ref_tok], 1)
    fmask = torch.cat([mask, torch.ones_like(ref_tok)], 1)

    def forced_logits(cache):
        start = cache.new_request(ids, mask)
        out = [model(ids[:, start:], attention_mask=mask, **th.cache_kwargs(model, cache),
                     position_ids=(mask.cumsum(1) - 1).clamp(min=0)[:, start:]).logits[:, -1]]
        for i in range(ids.shape[1], forced.shape[1] - 1):
            out.append(model(forced[:, i:i + 1], **th.cache_kwargs(model, cache), position_ids=(fmask[:, :i + 1].sum(1, keepdim=True) - 1)
                             ).logits[:, -1])
        return torch.stack(out, 1).float()

    for sparse in (None, th.SparseConfig(top_k=1024)):
        cache = th.enable_kvpool(model, num_blocks=128, block_size=16, sparse=sparse)
        got = forced_logits(cache)
        assert (got - ref_logits).abs().max().item() < 0.05, sparse
        again = forced_logits(cache)  # second request: the prompts' full blocks come from the prefix cache
        assert cache.stats()["prompt_tokens_cached"] > 0
        assert (again - ref_logits).abs().max().item() < 0.05, sparse
        cache.pool.check_invariants()


def test_static_decode_steps_equal_ordinary_steps():
    """The CUDA-graph path's host/device split (prepare_static_step, then a forward), run eagerly."""
    model = tiny("llama")
    ids, mask = prompts([40, 40])
    ref_tok, _ = greedy(model, ids, mask, n=5)
    cache = th.enable_kvpool(model, num_blocks=32, block_size=8)
    start = cache.new_request(ids, mask)
    x = model(ids[:, start:], **th.cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
    toks = [x]
    cache.begin_static_decode(max_blocks=8)
    with pytest.raises(th.CacheMismatchError, match="prepare_static_step"):
        cache.prepare_static_step()
        model(x, **th.cache_kwargs(model, cache))
        model(x, **th.cache_kwargs(model, cache))  # a second forward without its prepare_static_step
    cache.reset()
    start = cache.new_request(ids, mask)
    x = model(ids[:, start:], **th.cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
    cache.begin_static_decode(max_blocks=8)
    toks = [x]
    for i in range(4):
        cache.prepare_static_step()
        pos = torch.full((2, 1), 40 + i)
        x = model(x, **th.cache_kwargs(model, cache), position_ids=pos).logits[:, -1].argmax(-1, keepdim=True)
        toks.append(x)
    assert torch.equal(torch.cat(toks, 1), ref_tok)
    cache.end_static_decode()
    cache.pool.check_invariants()


def test_a_chat_turn_reuses_the_previous_answer():
    """Generated tokens are hashed too: the next request containing them skips their prefill."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(3)
    turn1 = torch.randint(1, VOCAB, (1, 40), generator=g)
    cache = th.enable_kvpool(model, num_blocks=64, block_size=8)
    out1 = model.generate(turn1, attention_mask=torch.ones_like(turn1), **th.cache_kwargs(model, cache), max_new_tokens=30,
                          do_sample=False)
    turn2 = torch.cat([out1, torch.randint(1, VOCAB, (1, 6), generator=g)], 1)
    th.disable_kvpool(model)
    cold_tok, cold_logits = greedy(model, turn2, torch.ones_like(turn2), n=4)
    cache = th.enable_kvpool(model, num_blocks=64, block_size=8)
    model.generate(turn1, attention_mask=torch.ones_like(turn1), **th.cache_kwargs(model, cache), max_new_tokens=30, do_sample=False)
    before = cache.stats()["prompt_tokens_cached"]
    tok, logits = greedy(model, turn2, torch.ones_like(turn2), n=4, **th.cache_kwargs(model, cache))
    # The pool holds turn 1's prompt and 29 of its 30 answers (the last was never fed back): 8 full blocks.
    assert cache.stats()["prompt_tokens_cached"] - before == 64
    assert torch.equal(tok, cold_tok)
    assert (logits - cold_logits).abs().max().item() < 1e-4
    cache.pool.check_invariants()


def test_a_forward_failing_midway_is_reported_at_the_next_step():
    model = tiny("llama")
    ids, mask = prompts([20, 20])
    cache = th.enable_kvpool(model, num_blocks=16, block_size=8)
    start = cache.new_request(ids, mask)
    model(ids[:, start:], **th.cache_kwargs(model, cache))
    layer1 = model.model.layers[1].self_attn

    def boom(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    layer1.forward = boom
    x = torch.ones(2, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="simulated"):
        model(x, **th.cache_kwargs(model, cache))
    del layer1.forward
    cache.pool.check_invariants()
    assert [cache.pool.num_tokens(s) for s in cache.seq_ids] == [21, 21]  # kept, not freed
    with pytest.raises(th.CacheMismatchError, match="layers 0..0 of 2"):
        model(x, **th.cache_kwargs(model, cache))
    out = model.generate(ids, attention_mask=mask, **th.cache_kwargs(model, cache), max_new_tokens=2, do_sample=False)
    assert out.shape == (2, 22)  # a new request starts clean
    cache.pool.check_invariants()


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-3), (torch.float8_e4m3fn, 2e-2)])
def test_a_narrower_pool_dtype_stays_close(dtype, tol):
    """K/V stored in bf16 (8 mantissa bits) or fp8 e4m3 (per-block scales): logits within `tol` of fp32.

    Measured on this model (max |logit| 0.60): bf16 4e-4, fp8 7e-3.
    """
    model = tiny("llama")
    ids, mask = prompts([37, 20])
    ref_tok, ref_logits = greedy(model, ids, mask)
    cache = th.enable_kvpool(model, num_blocks=32, block_size=8, dtype=dtype)
    assert cache.pool.dtype == dtype
    tok, logits = greedy(model, ids, mask, **th.cache_kwargs(model, cache))
    assert (logits - ref_logits).abs().max().item() < tol
    cache.pool.check_invariants()


def test_prefix_caching_off_prefills_every_request():
    model = tiny("llama")
    ids, mask = prompts([37, 20])
    ref_tok, _ = greedy(model, ids, mask)
    cache = th.enable_kvpool(model, num_blocks=32, block_size=8, prefix_caching=False)
    greedy(model, ids, mask, **th.cache_kwargs(model, cache))
    tok, _ = greedy(model, ids, mask, **th.cache_kwargs(model, cache))
    assert torch.equal(tok, ref_tok)
    assert cache.stats()["prompt_tokens_cached"] == 0


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_matches_eager():
    """A whole model decode step captured in a CUDA graph (static decode), dense and sparse, vs eager steps.

    Teacher-forced on the eager run's tokens; logits within 0.05 (bf16; the graph's prompt comes
    from the prefix cache, its last partial block recomputed, so the K/V may differ in the last bit).
    """
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = tiny("llama", dtype=torch.bfloat16, device="cuda", hidden_size=512, intermediate_size=1024,
                 num_attention_heads=8, num_key_value_heads=2)
    ids, _ = prompts([100, 100])
    ids = ids.cuda()
    B, S, steps = 2, 100, 6
    for sparse in (None, th.SparseConfig(top_k=4)):
        cache = th.enable_kvpool(model, num_blocks=64, block_size=16, sparse=sparse)
        with torch.no_grad():
            start = cache.new_request(ids)
            x = model(ids[:, start:], **th.cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
            tokens, eager = [x], []
            for i in range(steps):
                logits = model(x, **th.cache_kwargs(model, cache), position_ids=torch.full((B, 1), S + i, device="cuda")).logits[:, -1]
                eager.append(logits.float())
                x = logits.argmax(-1, keepdim=True)
                tokens.append(x)
            start = cache.new_request(ids)  # the same prompts again: served by the prefix cache
            assert start == 96
            model(ids[:, start:], **th.cache_kwargs(model, cache))
            cache.begin_static_decode(max_blocks=16)
            x_static = tokens[0].clone()
            pos = torch.full((B, 1), S, device="cuda")
            graph = torch.cuda.CUDAGraph()
            cache.prepare_static_step()
            with torch.cuda.graph(graph):
                out = model(x_static, **th.cache_kwargs(model, cache), position_ids=pos)
            got = []
            for i in range(steps):
                if i:
                    cache.prepare_static_step()
                    x_static.copy_(tokens[i])
                    pos.fill_(S + i)
                graph.replay()
                got.append(out.logits[:, -1].float().clone())
            cache.end_static_decode()
        for i in range(steps):
            assert (got[i] - eager[i]).abs().max().item() < 0.05, (sparse, i)
        cache.pool.check_invariants()
        th.disable_kvpool(model)


def test_the_step_block_tables_are_the_pools_through_forks_and_growth():
    """The cache's incrementally updated tables equal KVPool.block_table at every decode step."""
    model = tiny("llama")
    ids, mask = prompts([21])
    cache = th.enable_kvpool(model, num_blocks=64, block_size=4)
    seen = []

    def check(layer, q, block_table, seq_lens, block_indices):
        if layer == 0:
            want = cache.pool.block_table(cache.seq_ids)
            w = want.shape[1]
            assert torch.equal(block_table[:, :w], want) and bool((block_table[:, w:] == -1).all())
            assert torch.equal(seq_lens, cache.pool.seq_lens(cache.seq_ids))
            seen.append(w)

    cache.observer = check
    torch.manual_seed(0)  # parallel sampling: forks, then copy-on-write of the shared partial block
    model.generate(ids, attention_mask=mask, **th.cache_kwargs(model, cache), max_new_tokens=9, do_sample=True, num_return_sequences=3)
    model.generate(ids, attention_mask=mask, **th.cache_kwargs(model, cache), max_new_tokens=6, num_beams=2, do_sample=False)  # reorders
    sid = cache.seq_ids[0]
    slots = cache.pool.append(sid, 3)  # the pool used directly: the next step rebuilds its table
    for layer in range(2):
        cache.pool.write(layer, slots, torch.zeros(3, 2, 16), torch.zeros(3, 2, 16))
    n = cache.pool.num_tokens(sid)
    model(torch.ones(len(cache.seq_ids), 1, dtype=torch.long), **th.cache_kwargs(model, cache),
          position_ids=torch.tensor([[cache.pool.num_tokens(s)] for s in cache.seq_ids]))
    assert cache.pool.num_tokens(sid) == n + 1
    assert len(seen) >= 8 + 5 + 1 and max(seen) >= 8
    cache.pool.check_invariants()
