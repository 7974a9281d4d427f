"""The decoding step's StaticCache write, in the decode kernel's launch (`kernels/cache_write.py`), against
transformers' own `StaticLayer.update`: the same keys, values and length, bit for bit, and the step's attention over
them (the formula); nothing written beyond the cache; every other cache and layer through `Cache.update`."""

import pytest
import torch
from transformers.cache_utils import DynamicCache, StaticCache, StaticLayer, StaticSlidingWindowLayer

from modeling_diff.kernels import _triton, triton_decode
from modeling_diff.kernels.cache_write import _static_layer, static_cache_write_applies, update_cache
from modeling_diff.kernels.decode import DexCombine, combined_decode_attention

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


def kernel_step(cache, key, value):
    """A decoding step of one query head per kv head through the decode kernel, the cache's write in its launch
    (DEX's combine with a zero operator: plain attention) -> (keys, values, write, output (B, L, H, Dv), the
    reference's inputs: query and the visible positions (B, L, S), causal from the layer's length)."""
    keys, values, write = update_cache(cache, 0, key, value)
    batch, heads, length, dk = key.shape
    dv = value.shape[-1]
    start = cache.layers[0].cumulative_length.item()
    query = torch.randn(batch, heads, length, dk, dtype=DTYPE, device=DEVICE)
    positions = torch.arange(keys.shape[2], device=DEVICE)
    visible = (positions[None, :] <= start + torch.arange(length, device=DEVICE)[:, None]).expand(batch, -1, -1)
    combine = DexCombine(torch.zeros(dv, dv, dtype=DTYPE, device=DEVICE), torch.zeros(heads, device=DEVICE),
                         torch.zeros(1, device=DEVICE), torch.zeros((), dtype=torch.long, device=DEVICE), 0, 0.0)
    out = combined_decode_attention(query, keys, values, visible[:, None].contiguous(), dk ** -0.5, combine, None, write)
    return keys, values, write, out, query, visible


def attention_formula(query, keys, values, visible):
    """softmax(q k^T / sqrt(d), visible) v in float64 -> (B, L, H, Dv)."""
    scores = query.double() @ keys.double().transpose(-1, -2) * query.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return (scores.softmax(-1) @ values.double()).transpose(1, 2)


@pytest.mark.parametrize("batch, heads, length, dk, dv, transposed", [
    (2, 2, 1, 16, 32, True), (1, 4, 1, 16, 16, False), (3, 2, 3, 16, 32, True), (2, 8, 2, 128, 128, True),
])
def test_the_write_equals_transformers_update(batch, heads, length, dk, dv, transposed, monkeypatch):
    """Several steps, in chunks of 16 keys (several programs share the ticket, which is 0 again after each launch):
    keys, values and the length equal StaticLayer.update's, and the step's attention sees the new entries."""
    monkeypatch.setattr(triton_decode, "PARTIAL_BLOCK_N", 16)
    reference, fast = prefilled_caches(batch, heads, dk, dv, max_cache_len=40)
    layer = fast.layers[0]
    for _ in range(2):
        key, value = step(batch, heads, length, dk, dv, transposed)
        assert static_cache_write_applies(_static_layer(fast, 0), key, value)
        expected = reference.update(key, value, 0)
        keys, values, write, out, query, visible = kernel_step(fast, key, value)
        assert keys is layer.keys and values is layer.values and write is not None
        torch.testing.assert_close(keys, expected[0], rtol=0, atol=0)
        torch.testing.assert_close(values, expected[1], rtol=0, atol=0)
        assert layer.cumulative_length.item() == reference.layers[0].cumulative_length.item()
        assert _triton._TICKETS[id(layer)][key.device].item() == 0
        tolerance = 1e-4 if DTYPE == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), attention_formula(query, *expected, visible), rtol=tolerance,
                                   atol=tolerance)
    assert fast.get_seq_length() == 5 + 2 * length


def test_a_write_cut_short_leaves_the_length_and_no_ticket(monkeypatch):
    """A launch that stops part-way (a program took its ticket, then an interrupt) leaves the layer's length as it
    was and the ticket at 0; the next step's write equals StaticLayer.update's."""
    reference, fast = prefilled_caches(dk=16)
    layer = fast.layers[0]
    key, value = step(length=2, dk=16)

    class TicketTaken:  # the launch: a program's ticket, then the interrupt
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                _triton._TICKETS[id(layer)][key.device].add_(1)
                raise KeyboardInterrupt
            return launch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_decode, "_decode_partial", TicketTaken())
        with pytest.raises(KeyboardInterrupt):
            kernel_step(fast, key, value)
    assert layer.cumulative_length.item() == 5 and _triton._TICKETS[id(layer)][key.device].item() == 0
    expected = reference.update(key, value, 0)
    keys, values, *_ = kernel_step(fast, key, value)
    torch.testing.assert_close(keys, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(values, expected[1], rtol=0, atol=0)
    assert layer.cumulative_length.item() == 7


def test_positions_beyond_the_cache_are_not_written():
    """A step that runs past max_cache_len writes the positions that exist and nothing beyond them (the layer's
    tensors are views of larger ones here, whose rest must stay zero), and advances the length as transformers
    does."""
    _, fast = prefilled_caches(batch=2, dk=16, prompt=10, max_cache_len=12)
    layer = fast.layers[0]
    spare = [torch.zeros(*t.shape[:2], 20, t.shape[3], dtype=DTYPE, device=DEVICE) for t in (layer.keys, layer.values)]
    for backing, t in zip(spare, (layer.keys, layer.values)):
        backing[:, :, :12] = t
    layer.keys, layer.values = (backing[:, :, :12] for backing in spare)
    keys_before = layer.keys.clone()
    key, value = step(batch=2, length=4, dk=16)
    kernel_step(fast, key, value)
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
    assert _static_layer(DynamicCache(), 0) is None
    assert _static_layer(StaticCache(config=tiny_config("v2", num_hidden_layers=1), max_cache_len=8), 0) is None

    class Logged(StaticCache):
        def update(self, *args, **kwargs):
            return super().update(*args, **kwargs)

    assert _static_layer(Logged(config=tiny_config("v2", num_hidden_layers=1), max_cache_len=8), 0) is None
    sliding = StaticSlidingWindowLayer(max_cache_len=48, sliding_window=4)
    sliding.update(key, value)  # initialized
    windowed = prefilled_caches(max_cache_len=48)[1]
    windowed.layers[0] = sliding
    assert _static_layer(windowed, 0) is None
    fast.offloading = True
    assert _static_layer(fast, 0) is None
    fast.offloading = False
    layer = _static_layer(fast, 0)
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
    assert update_cache(fast, 0, *wide)[2] is None
    assert calls == [1]
