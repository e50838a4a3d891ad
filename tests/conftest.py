"""Shared builders of the umbrella's tests (the repo's root conftest.py handles the gpu markers)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def make_llama():
    """make_llama(dtype, device, hidden, ffn, **config): a 2-layer transformers LlamaForCausalLM (4 heads, 2 kv
    heads, vocab 512; seed 0, eval mode) built from a config with random weights."""
    transformers = pytest.importorskip("transformers")

    def make(dtype=torch.float32, device="cpu", hidden=256, ffn=512, **config):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, **config)
        with torch.device(device):
            return transformers.LlamaForCausalLM(cfg).to(dtype).eval()

    return make
