"""Attention for decoding steps through the Triton split-KV kernel (`triton_decode.py`); the plain path, and
the reference, is SDPA (`attention.py` falls back to it for everything the kernel does not cover).

During decoding each step reads the whole KV cache for a handful of query tokens, so the step is bound by
the bytes of the cache. The kernel reads every cache entry once per step for all query heads of its GQA
group (SDPA under torch.compile instead expands K and V to one copy per query head), and splits the
sequence over the multiprocessors so that batch 1 fills the GPU too.

The differential modes' decoding steps (`diff_decode_attention`) take the same kernel with the combine of each
head pair in its reduce (V1: lambda, computed in the kernel from its four vectors, and subln; V2: the noise
weight), so a step of a differential layer costs two launches, like a Llama's attention call. Its reference is
the modules' plain path: one attention call, then `combine.v1_combine` or `v2_combine`.
"""

import torch

from torch import nn

from ._triton import TRITON_AVAILABLE, TRITON_INTERPRETING, eager_kernels_run_on, is_power_of_2, needs_grad

if TRITON_AVAILABLE:
    from .triton_decode import decode_attention_kernels, decode_attention_op, diff_decode_kernels

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


def diff_decode_applies(pairs, key, value, mask, dropout: float) -> bool:
    """Whether a differential decoding step can take `diff_decode_attention` (eager, on CUDA or the interpreter);
    pairs (B, L, h, 2, DQ) as the modules hold their queries."""
    query = pairs.flatten(2, 3).transpose(1, 2)  # (B, 2h, L, DQ): the rows the kernel reads
    return (
        eager_kernels_run_on(pairs)
        and key.shape[-1] in (pairs.shape[-1], 2 * pairs.shape[-1])
        and (2 * pairs.shape[2]) % key.shape[1] == 0
        and decode_kernel_applies(query, key, value, mask, dropout)
    )


def diff_decode_attention(pairs, key, value, mask, scale: float, mu, norm: nn.Module | None = None,
                          norm_scale: float = 1.0, lambda_vectors=None, lambda_init: float = 0.0) -> torch.Tensor:
    """A differential decoding step: both maps of every head, merged and combined, in two launches.

    pairs (B, L, h, 2, DQ) = (Q1, Q2) per differential head (the last dim contiguous); key (B, h_kv, S, 2 DQ)
    = K1|K2 (V1) or (B, h_kv, S, DQ) (V2); value (B, h_kv, S, DV); mask as `decode_attention`.
    V1: norm = subln, norm_scale = 1 - lambda_init, lambda_vectors = (lambda_q1, lambda_k1, lambda_q2,
    lambda_k2) and lambda_init (lambda is computed in the kernel); V2: mu = the noise weight (B, L, h).
    Returns the combined head outputs (B, L, h, DV)."""
    pairs, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (pairs, key, value))
    if norm is None:
        return diff_decode_kernels(pairs, key, value, mask, scale, mu, None, 0.0, 1.0, None, 0.0)
    vectors = tuple(v if v.stride(0) == 1 else v.contiguous() for v in lambda_vectors)
    return diff_decode_kernels(
        pairs, key, value, mask, scale, None, norm.weight, norm.variance_epsilon, norm_scale, vectors, lambda_init
    )
