"""tilestack.hf: long-context generation of transformers models on kvpool (extra `tilestack[hf]`).

    cache = tilestack.hf.enable_kvpool(model, num_blocks=4096, sparse=SparseConfig(top_k=64))
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    cache.stats()["prefix_hit_rate"]

`enable_kvpool` switches the model's attention to kvpool's paged attention (registered with
transformers' AttentionInterface as "tilestack_kvpool") and returns a `KVPoolCache` (transformers'
Cache interface on a `KVPool`). Each `generate` call is a new request: its prompts share every
full block the pool still holds from earlier requests, so a long shared prefix is not prefilled
again. `disable_kvpool` gives the model its own attention back. See docs/tilestack.md.
"""

from __future__ import annotations

import functools

from tilehal import ArgumentError

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tilestack.hf needs transformers: pip install 'tilestack[hf]'") from e

import torch
from kvpool import KVPool
from transformers.cache_utils import get_layer_types_and_kwargs

from . import attention as _attention
from .cache import KVPoolCache, SparseConfig
from .errors import (
    CacheMismatchError,
    KVPoolCacheError,
    PoolExhaustedError,
    SequenceTooLongError,
    UnsupportedModelError,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_STATE = "_tilestack_kvpool_state"

_attention.register()


def _attention_modules(model) -> list[torch.nn.Module]:
    mods = [m for m in model.modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    return sorted(mods, key=lambda m: m.layer_idx)


def _check_model(model) -> tuple[object, int | None]:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model: expected a transformers model of type {', '.join(SUPPORTED_MODEL_TYPES)}, got "
            f"{type(model).__name__} (model_type {model_type!r})")
    text = config.get_text_config(decoder=True)
    layer_types, kwargs = get_layer_types_and_kwargs(text)
    window = None
    for i, (t, kw) in enumerate(zip(layer_types, kwargs)):
        if t == "sliding_attention":
            window = kw["sliding_window"] if window is None else min(window, kw["sliding_window"])
        elif t != "full_attention":
            raise UnsupportedModelError(f"model: layer {i} is {t!r}; tilestack.hf runs full (or sliding-window, "
                                        f"below the window) attention layers only")
    mods = _attention_modules(model)
    if [m.layer_idx for m in mods] != list(range(text.num_hidden_layers)):
        raise UnsupportedModelError(f"model: expected one attention module per layer 0..{text.num_hidden_layers - 1} "
                                    f"with a layer_idx, found {[m.layer_idx for m in mods]}")
    if not model._can_set_attn_implementation():
        raise UnsupportedModelError(f"model: {type(model).__name__} does not dispatch attention through "
                                    f"transformers' AttentionInterface")
    return text, window


def enable_kvpool(model, *, num_blocks: int, block_size: int = 16, dtype: torch.dtype | None = None,
                  sparse: SparseConfig | None = None, prefix_caching: bool = True) -> KVPoolCache:
    """Run `model` (Llama / Mistral / Qwen2) on a new KVPool; returns the cache to pass as past_key_values.

    The pool has `num_blocks` blocks of `block_size` tokens per layer, in `dtype` (default: the
    model's), on the model's device. `sparse` makes decode steps attend to Quest-selected blocks
    only. Raises UnsupportedModelError for another architecture.
    """
    text, window = _check_model(model)
    if sparse is not None and not isinstance(sparse, SparseConfig):
        raise ArgumentError(f"sparse: expected a tilestack.hf.SparseConfig or None, got {type(sparse).__name__}")
    param = next(model.parameters())
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    pool = KVPool(num_layers=text.num_hidden_layers, num_kv_heads=text.num_key_value_heads, head_dim=head_dim,
                  num_blocks=num_blocks, block_size=block_size, dtype=dtype or param.dtype, device=param.device,
                  prefix_caching=prefix_caching, summary_dtype=sparse.summary_dtype if sparse else None)
    cache = KVPoolCache(pool, sparse=sparse, max_tokens=window, window=window)
    state = getattr(model, _STATE, None)
    if state is None:
        state = {"attn": model.config._attn_implementation, "prepare": vars(model).get("prepare_inputs_for_generation")}
        original = model.prepare_inputs_for_generation

        @functools.wraps(original)
        def prepare_inputs_for_generation(input_ids, *args, **kwargs):
            c = kwargs.get("cache", kwargs.get("past_key_values"))
            if isinstance(c, KVPoolCache):
                if kwargs.get("is_first_iteration"):
                    start = c.new_request(input_ids, kwargs.get("attention_mask"))
                    kwargs["next_sequence_length"] = input_ids.shape[1] - start
                else:
                    c.set_next_tokens(input_ids[:, -(kwargs.get("next_sequence_length") or input_ids.shape[1]):])
            return original(input_ids, *args, **kwargs)

        model.prepare_inputs_for_generation = prepare_inputs_for_generation
        setattr(model, _STATE, state)
        model.set_attn_implementation(_attention.NAME)
    for m in _attention_modules(model):
        m._tilestack_kvpool = cache
    return cache


def cache_kwargs(model, cache) -> dict:
    """`{keyword: cache}` for `model(...)` / `model.generate(...)` under the installed transformers.

    transformers 5 renamed the forward's `past_key_values` to `cache` (the old name deprecated, not
    removed); an older 5.x takes an unknown `cache=` into **kwargs, so the model runs without it and
    the paged attention refuses the step (CacheMismatchError). Code meant to run on any release
    tilestack[hf] allows passes `**cache_kwargs(model, cache)`.
    """
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_type: type) -> str:
    import inspect

    params = inspect.signature(model_type.forward).parameters  # follows deprecate_kwarg's __wrapped__
    return "cache" if "cache" in params else "past_key_values"


def disable_kvpool(model) -> None:
    """Give the model its own attention back (the implementation it had before enable_kvpool)."""
    state = getattr(model, _STATE, None)
    if state is None:
        return
    for m in _attention_modules(model):
        m.__dict__.pop("_tilestack_kvpool", None)
    if state["prepare"] is None:
        del model.prepare_inputs_for_generation
    else:
        model.prepare_inputs_for_generation = state["prepare"]
    model.set_attn_implementation(state["attn"])
    delattr(model, _STATE)


__all__ = [
    "CacheMismatchError", "KVPoolCache", "KVPoolCacheError", "PoolExhaustedError", "SequenceTooLongError",
    "SparseConfig", "SUPPORTED_MODEL_TYPES", "UnsupportedModelError", "cache_kwargs", "disable_kvpool",
    "enable_kvpool",
]
