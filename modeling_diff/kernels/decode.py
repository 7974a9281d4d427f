"""Attention for decoding steps through the Triton split-KV kernel (`triton_decode.py`); the plain path, and
the reference, is SDPA (`attention.py` falls back to it for everything the kernel does not cover).

During decoding each step reads the whole KV cache for a handful of query tokens, so the step is bound by
the bytes of the cache. The kernel reads every cache entry once per step for all query heads of its GQA
group (SDPA under torch.compile instead expands K and V to one copy per query head), and splits the
sequence over the multiprocessors so that batch 1 fills the GPU too.
"""

import torch

from ._triton import TRITON_AVAILABLE, TRITON_INTERPRETING, is_power_of_2, needs_grad

if TRITON_AVAILABLE:
    from .triton_decode import decode_attention_kernels, decode_attention_op

MAX_GROUP_ROWS = 64  # query heads per kv head x query tokens that one program holds


def decode_kernel_applies(query, key, value, mask, dropout: float) -> bool:
    """Shapes and options the kernel covers (forward only: no gradient); everything else goes to SDPA."""
    groups = query.shape[1] // key.shape[1]
    return (
        not needs_grad(query, key, value)
        and TRITON_AVAILABLE
        and (query.is_cuda or TRITON_INTERPRETING)
        and dropout == 0.0
        and groups * query.shape[2] <= MAX_GROUP_ROWS
        and all(n >= 16 and is_power_of_2(n) for n in (query.shape[-1], value.shape[-1]))
        and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1))
    )


def decode_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """softmax(Q K^T scale + mask) V with GQA through the kernel. query (B, Hq, L, Dq), key (B, Hkv, S, Dq),
    value (B, Hkv, S, Dv); mask: bool (B, 1, L, S), True = visible, or None = causal as transformers means it
    (`masks.py`).
    Returns (B, L, Hq, Dv), the layout of transformers' attention functions."""
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if torch.compiler.is_compiling():  # one node of the graph
        return decode_attention_op(query, key, value, mask, float(scale))
    return decode_attention_kernels(query, key, value, mask, float(scale))
