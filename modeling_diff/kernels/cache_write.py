"""The cache update of a decoding step: into a StaticCache layer inside the decode kernel's launch
(`triton_decode._decode_partial`), through `Cache.update` everywhere else.

    update_cache(cache, layer_idx, key (B, H_kv, L, Dk), value (B, H_kv, L, Dv)) -> (keys, values, write)

transformers' `StaticLayer.update` (the reference) issues five kernels a layer and step: an `arange` and an add
for the positions, the in-place add to the layer's length, and one `index_copy_` each for the keys and the values.
In a batch-1 step of the ~1.1B models they took ~7.6 us a layer, where the bytes take well under one (the
graph-replayed step's profile, benchmarks/RESULTS.md). Here the decode kernel does all of it in its own launch: it
reads the layer's length on the device (no synchronisation: it runs inside CUDA graphs), attends to each new token's
key and value where the cache has its position and stores them there, and advances the length. So `update_cache`
hands such a step's write to the kernel (`CacheWrite`) and returns the layer's tensors as they will be.

It applies to a decoding step without gradients on the kernels' devices, to a cache whose `update` is transformers'
own and not offloading, and to a layer that is exactly an initialized `StaticLayer` (not a sliding window, a
quantized or a user's layer) holding keys and values of the step's dtype, batch, heads and widths. Positions at or
beyond the cache's length are not written: the kernel does not raise on the device (a replayed graph could not);
`generate()` sizes the cache for every step, and transformers' own update fails there.
"""

from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, StaticLayer

from ._triton import eager_kernels_run_on, is_power_of_2, needs_grad, tickets_of

MAX_TOKENS = 64  # new tokens (batch x length) of a step, as the decode kernel takes


class CacheWrite(NamedTuple):
    """A step's keys and values for the decode kernel to store into a StaticCache layer (`update_cache`)."""

    key: torch.Tensor  # (B, H_kv, L, Dk), the step's
    value: torch.Tensor  # (B, H_kv, L, Dv)
    length: torch.Tensor  # the layer's `cumulative_length` (int64, one element): the first position, advanced by L
    ticket: torch.Tensor  # the layer's own (`_triton.tickets_of`), 0 between launches


def _static_layer(cache: Cache, layer_idx: int) -> StaticLayer | None:
    """The cache's layer `layer_idx` where the kernel may stand in for `cache.update`: transformers' own update, no
    offloading, an initialized plain StaticLayer; else None."""
    if type(cache).update is not Cache.update or getattr(cache, "offloading", False) or layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[layer_idx]
    return layer if type(layer) is StaticLayer and layer.is_initialized else None


def static_cache_write_applies(layer: StaticLayer | None, key: torch.Tensor, value: torch.Tensor) -> bool:
    if layer is None or needs_grad(key, value) or not eager_kernels_run_on(key):
        return False
    if not (type(key) is type(value) is type(layer.keys) is type(layer.values) is torch.Tensor):
        return False  # DTensors, subclasses: their own dispatch
    keys, values = layer.keys, layer.values
    return (
        key.shape[0] * key.shape[2] <= MAX_TOKENS
        and key.dtype == value.dtype == keys.dtype == values.dtype
        and key.device == value.device == keys.device == values.device == layer.cumulative_length.device
        and layer.cumulative_length.dtype == torch.int64 and layer.cumulative_length.numel() == 1
        and key.shape[:2] == keys.shape[:2] and value.shape[:2] == values.shape[:2]
        and key.shape[2] == value.shape[2]
        and key.shape[-1] == keys.shape[-1] and value.shape[-1] == values.shape[-1]
        and is_power_of_2(key.shape[-1]) and is_power_of_2(value.shape[-1])
        and all(t.stride(-1) == 1 for t in (key, value, keys, values))
    )


def update_cache(cache: Cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor):
    """For a decoding step through the decode kernel (`decode.combined_decode_attention`), which must follow:
    (the layer's keys, its values, the CacheWrite for the kernel) where the kernel writes into a StaticCache layer
    (see the module docstring), else cache.update(key, value, layer_idx) and None."""
    layer = _static_layer(cache, layer_idx)
    if static_cache_write_applies(layer, key, value):
        ticket = tickets_of(layer, 1, key.device)
        return layer.keys, layer.values, CacheWrite(key, value, layer.cumulative_length, ticket)
    return *cache.update(key, value, layer_idx), None
