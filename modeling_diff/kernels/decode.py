"""Attention for decoding steps through the Triton split-KV kernel (`triton_decode.py`); the plain path, and
the reference, is SDPA (`attention.py` falls back to it for everything the kernel does not cover).

During decoding each step reads the whole KV cache for a handful of query tokens, so the step is bound by
the bytes of the cache. The kernel reads every cache entry once per step for all query heads of its GQA
group (SDPA under torch.compile instead expands K and V to one copy per query head), and splits the
sequence over the multiprocessors so that batch 1 fills the GPU too.

The differential modes' decoding steps (`combined_decode_attention`) take the same kernel with the mode's
differential term in its reduce: V1's lambda (computed in the kernel from its four vectors) and subln, V2's noise
weight, DEX's operator. A step of a differential layer then costs two launches, like a Llama's attention call,
where the host would otherwise issue a dozen small ones. The reference is the modules' plain path.
"""

from typing import NamedTuple

import torch

from ._triton import TRITON_AVAILABLE, TRITON_INTERPRETING, eager_kernels_run_on, is_power_of_2, needs_grad

if TRITON_AVAILABLE:
    from .triton_decode import combined_decode_kernels, decode_attention_kernels, decode_attention_op

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


class V1Combine(NamedTuple):
    """V1: norm_scale * subln(O1 - lambda O2), lambda from (lambda_q1, lambda_k1, lambda_q2, lambda_k2)."""

    MODE = 0
    lambda_vectors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    lambda_init: float
    norm_weight: torch.Tensor
    eps: float
    norm_scale: float


class V2Combine(NamedTuple):
    """V2: O1 - sigmoid(z) min(1, t/T) O2; z = lambda_proj(x) (B, L, h), t the anneal_step buffer, T = anneal_steps."""

    MODE = 1
    noise_logits: torch.Tensor
    anneal_step: torch.Tensor
    anneal_steps: int


class DexCombine(NamedTuple):
    """DEX: O - lambda(t) mask_h O W^T per head h; W = f_D's weight (d, d), mask_h the selected heads (h,)."""

    MODE = 2
    operator: torch.Tensor
    head_mask: torch.Tensor
    lambda_learn: torch.Tensor
    anneal_step: torch.Tensor
    anneal_steps: int
    lambda_init: float


def combined_decode_applies(query, key, value, mask, dropout: float) -> bool:
    """Whether a decoding step can take `combined_decode_attention`: eager (on CUDA, or the interpreter) and
    shapes the decode kernel covers; query (B, Hq, L, DQ), key DQ or (V1) 2 DQ wide."""
    return (
        eager_kernels_run_on(query)
        and key.shape[-1] in (query.shape[-1], 2 * query.shape[-1])
        and decode_kernel_applies(query, key, value, mask, dropout)
    )


def combined_decode_attention(query, key, value, mask, scale: float, combine, out=None,
                              advance=None) -> torch.Tensor:
    """A decoding step of a differential layer in two launches: the maps of every query head, merged, and the
    mode's differential term (`combine`: V1Combine, V2Combine or DexCombine), whose coefficients (lambda, the
    noise weight) the kernel computes itself.

    query (B, Hq, L, DQ): V1 and V2 hold the maps of differential head i in query heads 2i and 2i+1 (V1's DQ wide,
    read against K1 and K2 of its 2 DQ wide key); key and value (B, H_KV, S, .); mask as `decode_attention`.
    Returns the heads' outputs (B, L, h, DV), h = Hq / 2 (V1, V2) or Hq (DEX): in `out` where given (contiguous, of
    that shape and query's dtype: the decoding graphs' input buffer), else in a new tensor. `advance`: a StaticCache
    layer's length (int64, 1 element) that the step's projections did not advance (`cache_write.written_layer`):
    the kernel adds the step's L tokens to it."""
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return combined_decode_kernels(query, key, value, mask, float(scale), combine, out, advance)
