"""The mask of a step into a StaticCache (`kernels/masks.static_step_mask`) against transformers' own
`create_causal_mask`: the same boolean mask at every step length, batch and cache fill; None (transformers' mask)
for what it does not make; and the model's StaticCache steps with it equal to the same steps with transformers'."""

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticSlidingWindowLayer
from transformers.masking_utils import create_causal_mask

import modeling_diff.modeling_diff_llama as modeling
from modeling_diff.kernels import masks, static_step_mask

from conftest import tiny_config, tiny_model

CACHE_KWARG = modeling.CACHE_KWARG


def filled_cache(config, batch: int, prompt: int, max_cache_len: int = 24) -> StaticCache:
    """A StaticCache whose layers hold `prompt` random tokens."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    heads, width = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    for layer_idx in range(config.num_hidden_layers):
        cache.update(torch.randn(batch, heads, prompt, 2 * width), torch.randn(batch, heads, prompt, width), layer_idx)
    return cache


def transformers_mask(config, embeds, cache, attention_mask=None):
    return create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=attention_mask,
                              position_ids=None, **{CACHE_KWARG: cache})


@pytest.mark.parametrize("implementation", ["sdpa", "diff_triton", "fused_diff"])
@pytest.mark.parametrize("batch, prompt, length", [(1, 5, 1), (2, 7, 3), (3, 1, 4), (2, 23, 1), (1, 0, 2)])
def test_the_mask_is_transformers_mask(batch, prompt, length, implementation):
    """(B, 1, L, S): key j visible to query i where j <= t + i, t the tokens already held; prompt 0 is a cache
    reset after use (its length back at 0, its buffers kept)."""
    config = tiny_config("v1")
    config._attn_implementation = implementation
    cache = filled_cache(config, batch, max(prompt, 1))
    if prompt == 0:
        cache.reset()
    embeds = torch.randn(batch, length, config.hidden_size)
    ours = static_step_mask(config, embeds, None, cache)
    theirs = transformers_mask(config, embeds, cache)
    expected = torch.arange(24)[None, :] <= prompt + torch.arange(length)[:, None]  # the rule, written out
    assert ours is not None and ours.shape == (batch, 1, length, 24) and ours.dtype == torch.bool
    assert torch.equal(ours, expected.expand(batch, 1, length, 24))
    if theirs is not None:  # transformers skips the mask of a prefill into an empty cache (SDPA's is_causal)
        assert torch.equal(ours, theirs)


def test_the_mask_follows_the_cache_length():
    """One (L, S) table per layer and length, compared with the length when the mask is made: steps after the
    first reuse the table and see one more key each."""
    config = tiny_config("v2")
    config._attn_implementation = "sdpa"
    cache = filled_cache(config, 1, 4)
    embeds = torch.randn(1, 1, config.hidden_size)
    for step in range(3):
        assert torch.equal(static_step_mask(config, embeds, None, cache), transformers_mask(config, embeds, cache))
        assert static_step_mask(config, embeds, None, cache)[0, 0, 0].sum() == 5 + step
        for layer in cache.layers:
            layer.cumulative_length.add_(1)
    assert len(masks._KEY_OFFSETS[cache.layers[0]]) == 1


@pytest.mark.parametrize("case", ["padding", "dynamic", "eager", "sliding", "empty", "long", "compiled"])
def test_what_it_does_not_make_is_left_to_transformers(case, monkeypatch):
    config = tiny_config("dex")
    config._attn_implementation = "sdpa"
    cache, attention_mask = filled_cache(config, 2, 3), None
    embeds = torch.randn(2, 1, config.hidden_size)
    if case == "padding":
        attention_mask = torch.ones(2, 4, dtype=torch.long)
    elif case == "dynamic":
        cache = DynamicCache(config=config)
    elif case == "eager":
        config._attn_implementation = "eager"
    elif case == "sliding":
        cache.layers[1] = StaticSlidingWindowLayer(max_cache_len=24, sliding_window=8)
    elif case == "empty":
        cache = StaticCache(config=config, max_cache_len=24)
    elif case == "long":
        embeds = torch.randn(2, masks.STEP_MASK_MAX_TOKENS + 1, config.hidden_size)
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert static_step_mask(config, embeds, attention_mask, cache) is None


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_static_cache_steps_equal_those_with_transformers_mask(mode, monkeypatch):
    """A prompt and three steps into a StaticCache: the logits with the mask equal those with transformers' mask."""
    model = tiny_model(mode, attn_implementation="sdpa")
    ids = torch.randint(3, model.config.vocab_size, (2, 9))

    def run():
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            out = [model(ids[:, :6], use_cache=True, **{CACHE_KWARG: cache}).logits]
            out += [model(ids[:, i:i + 1], use_cache=True, **{CACHE_KWARG: cache}).logits for i in range(6, 9)]
        return torch.cat(out, 1)

    calls = []
    made = modeling.static_step_mask
    monkeypatch.setattr(modeling, "static_step_mask", lambda *a: calls.append(made(*a)) or calls[-1])
    ours = run()
    assert sum(mask is not None for mask in calls) == 3  # the three steps; the prefill into an empty cache not
    monkeypatch.setattr(modeling, "static_step_mask", lambda *a: None)
    torch.testing.assert_close(ours, run(), rtol=0, atol=0)
