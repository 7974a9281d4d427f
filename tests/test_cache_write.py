"""The decoding step's StaticCache write (`kernels/cache_write.py`) against transformers' own `StaticLayer.update`:
the same keys, values and length, bit for bit; nothing written beyond the cache; every other cache and layer through
`Cache.update`."""

import pytest
import torch
from transformers.cache_utils import DynamicCache, StaticCache, StaticLayer, StaticSlidingWindowLayer

from modeling_diff.kernels import _triton, cache_write
from modeling_diff.kernels.cache_write import plain_static_layer, static_cache_write_applies, update_cache

from conftest import tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32


def prefilled_caches(batch=2, heads=2, dk=8, dv=16, prompt=5, max_cache_len=12):
    """Two StaticCaches of one layer holding the same random prompt."""
    config = tiny_config("v2", num_hidden_layers=1)
    caches = [StaticCache(config=config, max_cache_len=max_cache_len) for _ in range(2)]
    key = torch.randn(batch, heads, prompt, dk, dtype=DTYPE, device=DEVICE)
    value = torch.randn(batch, heads, prompt, dv, dtype=DTYPE, device=DEVICE)
    for cache in caches:
        cache.update(key, value, 0)
    return caches


def step(batch=2, heads=2, length=1, dk=8, dv=16, transposed=True):
    """A step's key and value (B, H, L, D); `transposed`: views of (B, L, H, D), as the projections give them."""
    shape = (batch, length, heads) if transposed else (batch, heads, length)
    key = torch.randn(*shape, dk, dtype=DTYPE, device=DEVICE)
    value = torch.randn(*shape, dv, dtype=DTYPE, device=DEVICE)
    return (key.transpose(1, 2), value.transpose(1, 2)) if transposed else (key, value)


@pytest.mark.parametrize("batch, heads, length, dk, dv, transposed", [
    (2, 2, 1, 8, 16, True), (1, 4, 1, 16, 16, False), (3, 2, 3, 8, 16, True), (2, 8, 2, 1024, 1024, True),
])
def test_the_write_equals_transformers_update(batch, heads, length, dk, dv, transposed, monkeypatch):
    """Several steps: keys, values and the length equal StaticLayer.update's; several programs per step (tokens,
    and head blocks where BLOCK_ELEMENTS is small) share the ticket, which is 0 again after each launch."""
    monkeypatch.setattr(cache_write, "BLOCK_ELEMENTS", 1024)
    reference, fast = prefilled_caches(batch, heads, dk, dv)
    layer = fast.layers[0]
    for _ in range(2):
        key, value = step(batch, heads, length, dk, dv, transposed)
        assert static_cache_write_applies(plain_static_layer(fast, 0), key, value)
        expected = reference.update(key, value, 0)
        got = update_cache(fast, 0, key, value, {})
        assert got[0] is layer.keys and got[1] is layer.values
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
        assert layer.cumulative_length.item() == reference.layers[0].cumulative_length.item()
        assert _triton._TICKETS[id(layer)][key.device].item() == 0
    assert fast.get_seq_length() == 5 + 2 * length


def test_a_write_cut_short_leaves_the_length_and_no_ticket(monkeypatch):
    """A write that stops part-way (a program took its ticket, then an interrupt) leaves the layer's length as it
    was and the ticket at 0; the next step's write equals StaticLayer.update's."""

    class TicketTaken:  # the launch: a program's ticket (its 6th argument), then the interrupt
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                args[5].add_(1)
                raise KeyboardInterrupt
            return launch

    reference, fast = prefilled_caches()
    layer = fast.layers[0]
    key, value = step(length=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache_write, "_static_cache_write", TicketTaken())
        with pytest.raises(KeyboardInterrupt):
            update_cache(fast, 0, key, value, {})
    assert layer.cumulative_length.item() == 5 and _triton._TICKETS[id(layer)][key.device].item() == 0
    expected = reference.update(key, value, 0)
    got = update_cache(fast, 0, key, value, {})
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    assert layer.cumulative_length.item() == 7


def test_positions_beyond_the_cache_are_not_written():
    """A step that runs past max_cache_len writes the positions that exist and nothing beyond them (the layer's
    tensors are views of larger ones here, whose rest must stay zero), and advances the length as transformers
    does."""
    _, fast = prefilled_caches(batch=2, prompt=10, max_cache_len=12)
    layer = fast.layers[0]
    spare = [torch.zeros(*t.shape[:2], 20, t.shape[3], dtype=DTYPE, device=DEVICE) for t in (layer.keys, layer.values)]
    for backing, t in zip(spare, (layer.keys, layer.values)):
        backing[:, :, :12] = t
    layer.keys, layer.values = (backing[:, :, :12] for backing in spare)
    keys_before = layer.keys.clone()
    key, value = step(batch=2, length=4)
    update_cache(fast, 0, key, value, {})
    torch.testing.assert_close(layer.keys[:, :, :10], keys_before[:, :, :10], rtol=0, atol=0)
    torch.testing.assert_close(layer.keys[:, :, 10:], key[:, :, :2], rtol=0, atol=0)
    torch.testing.assert_close(layer.values[:, :, 10:], value[:, :, :2], rtol=0, atol=0)
    assert all(backing[:, :, 12:].abs().sum() == 0 for backing in spare)
    assert layer.cumulative_length.item() == 14


def test_other_caches_and_layers_take_cache_update(monkeypatch):
    """A DynamicCache, an offloading or a subclassed StaticCache, an uninitialized layer, a sliding-window layer,
    a step with gradients, another dtype, a tensor subclass or more tokens than the kernel takes: `Cache.update`."""
    calls = []
    update = StaticLayer.update
    monkeypatch.setattr(StaticLayer, "update", lambda self, *a, **kw: calls.append(1) or update(self, *a, **kw))
    _, fast = prefilled_caches(max_cache_len=48)
    key, value = step()
    assert plain_static_layer(DynamicCache(), 0) is None
    assert plain_static_layer(StaticCache(config=tiny_config("v2", num_hidden_layers=1), max_cache_len=8), 0) is None

    class Logged(StaticCache):
        def update(self, *args, **kwargs):
            return super().update(*args, **kwargs)

    assert plain_static_layer(Logged(config=tiny_config("v2", num_hidden_layers=1), max_cache_len=8), 0) is None
    sliding = StaticSlidingWindowLayer(max_cache_len=48, sliding_window=4)
    sliding.update(key, value)  # initialized
    windowed = prefilled_caches(max_cache_len=48)[1]
    windowed.layers[0] = sliding
    assert plain_static_layer(windowed, 0) is None
    fast.offloading = True
    assert plain_static_layer(fast, 0) is None
    fast.offloading = False
    layer = plain_static_layer(fast, 0)
    assert layer is not None
    assert not static_cache_write_applies(layer, key.requires_grad_(), value)
    key = key.detach()
    assert not static_cache_write_applies(layer, key.double(), value.double())
    class Marked(torch.Tensor):  # a tensor subclass keeps its own dispatch
        pass

    assert not static_cache_write_applies(layer, key.as_subclass(Marked), value)
    wide = step(batch=2, length=33)
    assert not static_cache_write_applies(layer, *wide)
    calls.clear()
    update_cache(fast, 0, *wide, {})
    assert calls == [1]


def projection_step(batch=2, length=1, width=64, d=8, kv_heads=2, cache_width=8):
    """A step's x (B, L, width), q, k, v layers (k and v: kv_heads heads of cache_width, the cache's) and cos, sin."""
    from torch import nn

    layers = [nn.Linear(width, n, bias=False).to(DEVICE, DTYPE) for n in (4 * d, kv_heads * cache_width,
                                                                         kv_heads * cache_width)]
    x = torch.randn(batch, length, width, dtype=DTYPE, device=DEVICE)
    cos, sin = (torch.randn(1, length, d, dtype=DTYPE, device=DEVICE) for _ in range(2))
    return x, layers, cos, sin


@pytest.mark.parametrize("batch, length, cache_width", [(2, 1, 8), (3, 2, 16), (1, 4, 8)])
@torch.no_grad()
def test_the_projections_store_k_and_v_where_transformers_update_would(batch, length, cache_width):
    """In steps of at most 16 tokens the projections' launch stores the rotated k and v into the StaticCache layer
    (`projection_cache_layer`; cache_width 2d: V1's K1|K2 heads): the layer's tensors then equal StaticLayer.update's
    with the same k and v, bit for bit, its length not advanced (the decode kernel's to advance); positions past the
    cache are not written. Several steps."""
    from modeling_diff.kernels import projection
    from modeling_diff.kernels.cache_write import mark_written, projection_cache_layer, written_layer

    torch.manual_seed(8)
    reference, fast = prefilled_caches(batch, 2, cache_width, cache_width, prompt=5, max_cache_len=5 + 2 * length)
    layer = fast.layers[0]
    for step_index in range(2):
        x, layers, cos, sin = projection_step(batch, length, cache_width=cache_width)
        assert projection.rotated_projections_apply(x, layers, cos, sin, 8)
        assert projection_cache_layer(fast, 0, x, layers[1].out_features, layers[2].out_features) is layer
        before = layer.cumulative_length.item()
        q, k, v = projection.rotated_projections(x, layers, cos, sin, 8, (layer.keys, layer.values,
                                                                          layer.cumulative_length))
        assert layer.cumulative_length.item() == before
        key = k.view(batch, length, 2, cache_width).transpose(1, 2)
        value = v.view(batch, length, 2, cache_width).transpose(1, 2)
        expected = reference.update(key, value, 0)
        torch.testing.assert_close(layer.keys, expected[0], rtol=0, atol=0)
        torch.testing.assert_close(layer.values, expected[1], rtol=0, atol=0)
        mark_written(layer, key)
        assert written_layer(fast, 0, key.clone()) is None  # another tensor's keys: not these
        assert written_layer(fast, 0, key) is layer and written_layer(fast, 0, key) is None  # handed over once
        layer.cumulative_length += length  # the decode kernel's part
    # a third step runs past the cache (transformers' update fails there): nothing is written
    x, layers, cos, sin = projection_step(batch, length, cache_width=cache_width)
    keys, values = layer.keys.clone(), layer.values.clone()
    projection.rotated_projections(x, layers, cos, sin, 8, (layer.keys, layer.values, layer.cumulative_length))
    assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_the_projections_do_not_write_where_the_kernel_would_not():
    """No layer for the projections where the separate write would not apply either: a DynamicCache, no cache,
    widths other than the layer's heads, another dtype or batch, more tokens than the kernel takes."""
    from modeling_diff.kernels.cache_write import projection_cache_layer

    _, fast = prefilled_caches(batch=2, heads=2, dk=8, dv=8)
    x, layers, _, _ = projection_step(batch=2)
    assert projection_cache_layer(fast, 0, x, 16, 16) is fast.layers[0]
    assert projection_cache_layer(None, 0, x, 16, 16) is None
    assert projection_cache_layer(DynamicCache(), 0, x, 16, 16) is None
    assert projection_cache_layer(fast, 0, x, 16, 24) is None
    assert projection_cache_layer(fast, 0, x.double(), 16, 16) is None
    assert projection_cache_layer(fast, 0, x[:1], 16, 16) is None
    assert projection_cache_layer(fast, 0, x.expand(2, 33, -1), 16, 16) is None


@torch.no_grad()
def test_a_length_out_of_range_writes_nothing_outside_the_cache():
    """A layer whose length is negative (a corrupted cache) or past its end: neither the write kernel nor the
    projections' launch stores anything outside the layer's tensors (views of larger ones here, whose other rows
    must stay zero)."""
    from modeling_diff.kernels import projection

    _, fast = prefilled_caches(batch=2, heads=2, dk=8, dv=8, max_cache_len=12)
    layer = fast.layers[0]
    spare = [torch.zeros(*t.shape[:2], 36, t.shape[3], dtype=DTYPE, device=DEVICE) for t in (layer.keys, layer.values)]
    for backing, t in zip(spare, (layer.keys, layer.values)):
        backing[:, :, 12:24] = t
    layer.keys, layer.values = (backing[:, :, 12:24] for backing in spare)
    for length in (-6, 12):
        layer.cumulative_length.fill_(length)
        key, value = step(batch=2, heads=2, length=2, dk=8, dv=8)
        update_cache(fast, 0, key, value, {})
        x, layers, cos, sin = projection_step(batch=2, length=2, cache_width=8)
        projection.rotated_projections(x, layers, cos, sin, 8, (layer.keys, layer.values, layer.cumulative_length))
        assert all(backing[:, :, :12].abs().sum() == 0 and backing[:, :, 24:].abs().sum() == 0 for backing in spare)


@pytest.mark.parametrize("mode", ["v1", "v2", "dex"])
def test_generate_into_a_static_cache_too_short_is_an_error_naming_the_length_needed(mode):
    """generate() with a StaticCache of 12 positions for a 10-token prompt and 6 new tokens: the kernels' writes
    left positions 12-14 unwritten and the tokens after them were computed without their keys, silently (V2 and DEX
    on diff_triton), where transformers' own update raises an IndexError on the CPU; on CUDA, where transformers
    compiles the step for a StaticCache, that update failed as a device-side assert (V1 on the H100), losing the
    process's CUDA context. A ValueError naming the length needed, before the first token (nothing is written into
    the cache); a cache long enough generates as before."""
    torch.manual_seed(0)
    from conftest import tiny_model

    model = tiny_model(mode, attn_implementation="diff_triton").to(DEVICE, DTYPE)
    ids = torch.randint(0, model.config.vocab_size, (3, 10), device=DEVICE)
    settings = dict(do_sample=False, max_new_tokens=6, eos_token_id=None)
    short = StaticCache(config=model.config, max_cache_len=12)
    with pytest.raises(ValueError, match=r"its StaticCache holds 12 positions, this generation needs up to 15 "):
        model.generate(ids, past_key_values=short, **settings)
    assert short.get_seq_length() == 0
    enough = model.generate(ids, past_key_values=StaticCache(config=model.config, max_cache_len=15), **settings)
    assert torch.equal(enough, model.generate(ids, **settings))
