"""What the Triton kernels take of transformers' attention mask: the mask's bytes, or the causal rule without one.

Without a mask: transformers' SDPA integration passes `attention_mask=None` when the mask is plain causal and calls SDPA with
`is_causal = L > 1`, which torch aligns top-left: query i sees keys 0..i. That is also what it does for a
StaticCache prefill from an empty cache, where the keys are the whole static buffer (S > L) and the tail is
empty. A single query (a decoding step) sees every key. With a mask, the mask decides.

The Triton kernels take this as one number, the causal offset: query i sees keys n <= i + offset. With a mask
they use the bottom-right offset S - L, which never hides a key the mask shows (a query's position is at most
S - L + i) and bounds the keys a query block has to visit.

`static_step_mask` makes transformers' mask of a step into a StaticCache without a padding mask in one launch.
"""

import weakref

import torch
from transformers.cache_utils import Cache, StaticLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .cache_write import plain_static_layer

STEP_MASK_MAX_TOKENS = 64  # query tokens of a step whose mask `static_step_mask` makes

# A StaticLayer -> {L: (L, S) int32 j - i}: key j is visible to query i of a step where j - i <= the layer's length
_KEY_OFFSETS: "weakref.WeakKeyDictionary[StaticLayer, dict[int, torch.Tensor]]" = weakref.WeakKeyDictionary()


def kernel_mask(mask: torch.Tensor | None, placeholder: torch.Tensor):
    """(tensor, (batch, query, key) strides) for a kernel: the bool mask (B or 1, 1, L, S) as uint8, batch stride 0
    when broadcast over the batch; without a mask, `placeholder` and zero strides (the kernels do not read it).
    Eagerly the bytes are viewed as uint8 (a decoding step asks this of every layer, and a copy was a kernel of
    2.8 us a layer on the H200); traced they are copied (a no-op on a uint8 mask): the H200's torch 2.11 failed
    to lower the bool -> uint8 bit view ("torch.bool is not supported by torch.iinfo", tests/test_compile.py).
    Traced means under Dynamo (`is_compiling`) or a tensor that is not a plain one: Inductor traces the decode
    op's implementation (`triton_decode.decode_attention_op`) with fake tensors, where `is_compiling()` need not
    be set (torch 2.13 sets it for the whole compile session and lowers the view)."""
    if mask is None:
        return placeholder, (0, 0, 0)
    if mask.dtype == torch.bool and type(mask) is torch.Tensor and not torch.compiler.is_compiling():
        mask = mask.view(torch.uint8)
    else:
        mask = mask.to(torch.uint8)
    return mask, (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2), mask.stride(3))


def causal_offset(length: int, kv_length: int, has_mask: bool) -> int:
    """Offset of the causal bound for `length` queries against `kv_length` keys (see the module docstring)."""
    if has_mask or length == 1:
        return kv_length - length
    return 0


def _key_offsets(layer: StaticLayer, length: int) -> torch.Tensor | None:
    """(L, S) j - i for the layer's S keys, made once per layer and step length outside CUDA graph captures (a
    capture would record its making, not keep it); None where it would be made inside one."""
    per_length = _KEY_OFFSETS.setdefault(layer, {})
    offsets = per_length.get(length)
    if offsets is None:
        device = layer.keys.device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        keys = torch.arange(layer.keys.shape[2], dtype=torch.int32, device=device)
        offsets = per_length[length] = keys[None, :] - torch.arange(length, dtype=torch.int32, device=device)[:, None]
    return offsets


def static_step_mask(config, inputs_embeds: torch.Tensor, attention_mask, cache: Cache | None) -> torch.Tensor | None:
    """transformers' `create_causal_mask` for a step of L <= STEP_MASK_MAX_TOKENS tokens into a StaticCache without
    a padding mask, for an implementation with SDPA's boolean mask: (B, 1, L, S), True where key j <= t + i, t the
    cache's length before the step, in one comparison. transformers' `sdpa_mask` builds it from aranges and adds:
    about eight launches, 6-8 us of a 0.81-0.89 ms graph-replayed step at batch 1 on the H200 (benchmarks/RESULTS.md).
    None where that does not hold: padding, other caches or layers (sliding windows, an update of their own,
    offloading: `cache_write.plain_static_layer`), other mask functions,
    torch.compile (Inductor fuses transformers'), or a CUDA graph capture before the step's first eager run."""
    if attention_mask is not None or cache is None or torch.compiler.is_compiling():
        return None
    batch, length = inputs_embeds.shape[:2]
    layers = getattr(cache, "layers", ())
    if not (0 < length <= STEP_MASK_MAX_TOKENS and layers):
        return None
    if ALL_MASK_ATTENTION_FUNCTIONS.get(config._attn_implementation) is not sdpa_mask:
        return None
    if any(plain_static_layer(cache, layer_idx) is None for layer_idx in range(len(layers))):
        return None  # every layer an initialized plain StaticLayer, transformers' update, no offloading
    first = layers[0]
    length_held = first.cumulative_length  # t, on the device
    if not (isinstance(length_held, torch.Tensor) and length_held.numel() == 1
            and length_held.device == first.keys.device == inputs_embeds.device):
        return None
    offsets = _key_offsets(first, length)
    if offsets is None:
        return None
    visible = offsets <= length_held.reshape(())  # (L, S)
    return visible[None, None].expand(batch, 1, length, offsets.shape[1])
