"""What the Triton kernels take of transformers' attention mask: the mask's bytes, or the causal rule without one.

Without a mask: transformers' SDPA integration passes `attention_mask=None` when the mask is plain causal and calls SDPA with
`is_causal = L > 1`, which torch aligns top-left: query i sees keys 0..i. That is also what it does for a
StaticCache prefill from an empty cache, where the keys are the whole static buffer (S > L) and the tail is
empty. A single query (a decoding step) sees every key. With a mask, the mask decides.

The Triton kernels take this as one number, the causal offset: query i sees keys n <= i + offset. With a mask
they use the bottom-right offset S - L, which never hides a key the mask shows (a query's position is at most
S - L + i) and bounds the keys a query block has to visit.
"""

import torch


def kernel_mask(mask: torch.Tensor | None, placeholder: torch.Tensor):
    """(tensor, (batch, query, key) strides) for a kernel: the bool mask (B or 1, 1, L, S) as uint8, batch stride 0
    when broadcast over the batch; without a mask, `placeholder` and zero strides (the kernels do not read it).
    Eagerly the bytes are viewed as uint8 (a decoding step asks this of every layer, and a copy was a kernel of
    2.8 us a layer on the H200); under torch.compile they are copied, since Inductor cannot lower a bool -> uint8
    view (a no-op on a uint8 mask)."""
    if mask is None:
        return placeholder, (0, 0, 0)
    if mask.dtype == torch.bool and not torch.compiler.is_compiling():
        mask = mask.view(torch.uint8)
    else:
        mask = mask.to(torch.uint8)
    return mask, (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2), mask.stride(3))


def causal_offset(length: int, kv_length: int, has_mask: bool) -> int:
    """Offset of the causal bound for `length` queries against `kv_length` keys (see the module docstring)."""
    if has_mask or length == 1:
        return kv_length - length
    return 0
