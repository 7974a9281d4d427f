"""The cache update of a decoding step: into a StaticCache layer in one launch (`triton_cache_write.py`), through
`Cache.update` everywhere else.

    update_cache(cache, layer_idx, key (B, H_kv, L, Dk), value (B, H_kv, L, Dv), kwargs) -> (keys, values) of the layer

transformers' `StaticLayer.update` (the reference) issues five kernels a layer and step: an `arange` and an add
for the positions, the in-place add to the layer's length, and one `index_copy_` each for the keys and the values.
In a batch-1 step of the ~1.1B models they took ~7.6 us a layer, where the bytes take well under one (the
graph-replayed step's profile, benchmarks/RESULTS.md). The kernel does all of it in one launch: it reads the
layer's length on the device (no synchronisation: it runs inside CUDA graphs), stores each new token's key and
value at its position, and advances the length.

It applies to a decoding step without gradients on the kernels' devices, to a cache whose `update` is transformers'
own and not offloading, and to a layer that is exactly an initialized `StaticLayer` (not a sliding window, a
quantized or a user's layer) holding keys and values of the step's dtype, batch, heads and widths. Positions at or
beyond the cache's length are not written: the kernel does not raise on the device (a replayed graph could not);
`generate()` sizes the cache it makes for every step, and refuses a StaticCache passed in that is shorter before
the first token (`check_static_cache_fits`).

In steps of at most 32 tokens the projections' launch stores the keys and values into the layer itself
(`kernels/projection.rotated_projections`, where `projection_cache_layer` gives it the layer), and the decode
kernel's reduce advances the length: no launch of its own. The projections mark the layer (`mark_written`) with
their output, and `written_layer` hands it to the decoding step that holds that output; a step that takes another
path calls `Cache.update`, which stores the same keys and values at the same positions again and advances the
length.
"""

import weakref

import torch
from transformers.cache_utils import Cache, StaticLayer

from ._triton import (
    TRITON_AVAILABLE, cdiv, dependent_launch, eager_kernels_run_on, is_power_of_2, needs_grad, next_power_of_2,
    tickets_of,
)

if TRITON_AVAILABLE:
    from .triton_cache_write import _static_cache_write

MAX_TOKENS = 64  # new tokens (batch x length) of a step the kernel takes, as the decode kernel
BLOCK_ELEMENTS = 4096  # about this many elements of keys and values per program


def plain_static_layer(cache: Cache, layer_idx: int) -> StaticLayer | None:
    """The cache's layer `layer_idx` where the kernel may stand in for `cache.update`: transformers' own update, no
    offloading, an initialized plain StaticLayer; else None."""
    if type(cache).update is not Cache.update or getattr(cache, "offloading", False) or layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[layer_idx]
    return layer if type(layer) is StaticLayer and layer.is_initialized else None


def _layer_takes(layer: StaticLayer, batch: int, tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
    """The layer's side of both writes (the kernel's and the projections'): plain tensors of `dtype` on `device`
    with contiguous rows and the step's batch, a length the kernels read (int64, one element, on the device), and at
    most MAX_TOKENS new tokens."""
    keys, values, length = layer.keys, layer.values, layer.cumulative_length
    return (
        type(keys) is type(values) is torch.Tensor  # DTensors, subclasses: their own dispatch
        and batch * tokens <= MAX_TOKENS and keys.shape[0] == values.shape[0] == batch
        and keys.dtype == values.dtype == dtype and keys.device == values.device == length.device == device
        and length.dtype == torch.int64 and length.numel() == 1
        and keys.stride(-1) == values.stride(-1) == 1
    )


def static_cache_write_applies(layer: StaticLayer | None, key: torch.Tensor, value: torch.Tensor) -> bool:
    if layer is None or needs_grad(key, value) or not eager_kernels_run_on(key):
        return False
    if not (type(key) is type(value) is torch.Tensor):
        return False  # DTensors, subclasses: their own dispatch
    keys, values = layer.keys, layer.values
    return (
        _layer_takes(layer, key.shape[0], key.shape[2], key.dtype, key.device)
        and value.dtype == key.dtype and value.device == key.device
        and key.shape[1] == keys.shape[1] and value.shape[:3] == (key.shape[0], values.shape[1], key.shape[2])
        and key.shape[-1] == keys.shape[-1] and value.shape[-1] == values.shape[-1]
        and is_power_of_2(key.shape[-1]) and is_power_of_2(value.shape[-1])
        and key.stride(-1) == value.stride(-1) == 1
    )


def write_static_cache(layer: StaticLayer, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """StaticLayer.update in one launch (check `static_cache_write_applies` first): key and value (B, H_kv, L, D)
    stored at the layer's positions t .. t + L - 1, its length advanced by L -> (keys, values), the layer's tensors."""
    batch, heads, length, dk = key.shape
    keys, values = layer.keys, layer.values
    ticket = tickets_of(layer, 1, key.device)  # the layer's own (`_triton.tickets_of`), 0 between launches
    block_h = min(next_power_of_2(heads), max(1, BLOCK_ELEMENTS // max(dk, value.shape[-1])))
    pdl = dependent_launch(key, batch * length)
    try:
        _static_cache_write[(batch * length, cdiv(heads, block_h))](
            key, value, keys, values, layer.cumulative_length, ticket,
            key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
            keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
            length, heads, keys.shape[2], DK=dk, DV=value.shape[-1], BLOCK_H=block_h, PDL=pdl, launch_pdl=pdl,
        )
    except BaseException:  # a launch cut short (the interpreter's programs run one by one) leaves no ticket taken
        ticket.zero_()
        raise
    return keys, values


def projection_cache_layer(cache: Cache | None, layer_idx: int, x: torch.Tensor, key_width: int,
                           value_width: int) -> StaticLayer | None:
    """The StaticCache layer into which the projections of x (B, L, hidden) may store the step's keys and values
    (key_width and value_width columns: whole heads of the layer's), else None: the layer's side of
    `static_cache_write_applies` (`_layer_takes`), on what the projections will produce."""
    layer = plain_static_layer(cache, layer_idx) if cache is not None else None
    if layer is None or not eager_kernels_run_on(x) or x.dim() != 3:
        return None
    keys, values = layer.keys, layer.values
    return layer if (
        _layer_takes(layer, x.shape[0], x.shape[1], x.dtype, x.device)
        and key_width == keys.shape[1] * keys.shape[3] and value_width == values.shape[1] * values.shape[3]
    ) else None


# layer -> the projections' output buffer whose keys and values the layer holds at its next positions
_WRITTEN: "weakref.WeakKeyDictionary[StaticLayer, torch.Tensor]" = weakref.WeakKeyDictionary()


def mark_written(layer: StaticLayer, key: torch.Tensor) -> None:
    """The projections stored `key` (a view of their output buffer) and its values into `layer`, its length not
    advanced."""
    _WRITTEN[layer] = key._base


def written_layer(cache: Cache, layer_idx: int, key: torch.Tensor) -> StaticLayer | None:
    """The layer, where the projections that produced `key` stored it (and its values) there (`mark_written`): the
    step takes the layer's tensors, and its length is the decode kernel's to advance. Else None."""
    layer = plain_static_layer(cache, layer_idx)
    if layer is None or key._base is None or _WRITTEN.get(layer) is not key._base:
        return None
    del _WRITTEN[layer]
    return layer


def check_static_cache_fits(cache: Cache, needed: int) -> None:
    """A ValueError before a generation whose `needed` positions (its max_length but the last token, as transformers
    sizes the StaticCache it makes) a plain StaticCache layer of `cache` cannot hold. The kernels leave positions
    beyond the layer unwritten (they cannot raise on the device), so the tokens after them were computed without
    their keys; on CUDA transformers compiles the decoding step for a StaticCache, and there its own update's
    index_copy_ failed as a device-side assert, which loses the process's CUDA context."""
    for layer in cache.layers:
        if type(layer) is StaticLayer and layer.max_cache_len < needed:
            raise ValueError(f"past_key_values: its StaticCache holds {layer.max_cache_len} positions, this "
                             f"generation needs up to {needed} (the prompt and max_new_tokens but the last). Pass a "
                             f"StaticCache of max_cache_len >= {needed}, or fewer new tokens")


def update_cache(cache: Cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor, kwargs: dict):
    """cache.update(key, value, layer_idx, kwargs=kwargs), through the kernel where it applies (see the module
    docstring). `kwargs`: the attention's keyword arguments, which transformers' caches may read or fill (the paged
    cache of continuous batching does)."""
    layer = plain_static_layer(cache, layer_idx)
    if static_cache_write_applies(layer, key, value):
        return write_static_cache(layer, key, value)
    return cache.update(key, value, layer_idx, kwargs=kwargs)
