"""Attention for decoding steps: a PyTorch reference and the Triton split-KV kernel (`triton_decode.py`).

During decoding each step reads the whole KV cache for a handful of query tokens, so the step is bound by
the bytes of the cache. The kernel reads every cache entry once per step for all query heads of its GQA
group (SDPA under torch.compile instead expands K and V to one copy per query head), and splits the
sequence over the multiprocessors so that batch 1 fills the GPU too.
"""

import functools

import torch

from ._triton import triton_available, triton_interpreting

MAX_GROUP_ROWS = 64  # query heads per kv head x query tokens that one program holds


def decode_attention_reference(query, key, value, mask, scale):
    """softmax(Q K^T scale + mask) V with GQA. query (B, Hq, L, Dq), key (B, Hkv, S, Dq), value (B, Hkv, S, Dv),
    mask: bool (B, 1, L, S), True = visible, or None = causal with the L queries at the end. -> (B, L, Hq, Dv)."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1).float()
    value = value.repeat_interleave(groups, dim=1).float()
    scores = query.float() @ key.transpose(-1, -2) * scale
    length, kv_length = query.shape[2], key.shape[2]
    if mask is None:
        mask = torch.ones(length, kv_length, dtype=torch.bool, device=query.device).tril(kv_length - length)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2).to(query.dtype)


def decode_kernel_applies(query, key, value, mask, dropout: float) -> bool:
    """Shapes and options the kernel covers (forward only: no gradient); everything else goes to SDPA."""
    groups = query.shape[1] // key.shape[1]
    return (
        not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
        and triton_available()
        and (query.is_cuda or triton_interpreting())
        and dropout == 0.0
        and groups * query.shape[2] <= MAX_GROUP_ROWS
        and all(n >= 16 and n & (n - 1) == 0 for n in (query.shape[-1], value.shape[-1]))
        and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1))
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.cache
def _decode_op():
    """Registers the kernel as the custom op `modeling_diff::decode_attention` (traceable by torch.compile
    with fullgraph=True); built on first use so that importing the package never imports triton."""
    try:  # guarded: transformers' remote-code loader requires unguarded imports of a Hub export to be installed
        import triton
    except ImportError as error:
        raise ImportError("modeling_diff's Triton decode kernel needs the triton package") from error
    from torch.library import triton_op, wrap_triton

    from .triton_decode import _decode_partial, _decode_reduce

    def launcher(kernel):
        return kernel if triton_interpreting() else wrap_triton(kernel)

    @triton_op("modeling_diff::decode_attention", mutates_args=())
    def decode_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        batch, q_heads, length, q_dim = query.shape
        kv_heads, kv_length, v_dim = key.shape[1], key.shape[2], value.shape[-1]
        groups = q_heads // kv_heads
        block_rows = max(16, triton.next_power_of_2(groups * length))
        block_n = 64
        # Enough chunks for about two programs per multiprocessor; the chunk length is a power of two (a
        # compile-time constant of the kernel), so a growing cache changes it, and recompiles, rarely.
        target = max(1, triton.cdiv(2 * _sm_count(query.device), batch * kv_heads))
        chunk = max(block_n, triton.next_power_of_2(triton.cdiv(kv_length, target)))
        splits = triton.cdiv(kv_length, chunk)
        parts = batch * kv_heads * splits * block_rows
        out_part = torch.empty(parts, v_dim, dtype=torch.float32, device=query.device)
        max_part = torch.empty(parts, dtype=torch.float32, device=query.device)
        sum_part = torch.empty(parts, dtype=torch.float32, device=query.device)
        out = torch.empty(batch, length, q_heads, v_dim, dtype=query.dtype, device=query.device)
        if mask is None:
            mask_arg, mask_strides = query, (0, 0, 0)  # unused
        else:
            mask_arg = mask.view(torch.uint8)
            mask_strides = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2), mask.stride(3))
        launcher(_decode_partial)[(batch * kv_heads, splits)](
            query, key, value, mask_arg, out_part, max_part, sum_part,
            query.stride(0), query.stride(1), query.stride(2),
            key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2),
            *mask_strides,
            kv_heads, kv_length, length, splits, scale,
            G=groups, HAS_MASK=mask is not None, BLOCK_R=block_rows, BLOCK_N=block_n, DQ=q_dim, DV=v_dim, CHUNK=chunk,
        )
        launcher(_decode_reduce)[(batch * kv_heads,)](
            out_part, max_part, sum_part, out, out.stride(0), out.stride(1), out.stride(2),
            kv_heads, length, splits, G=groups, BLOCK_R=block_rows, DV=v_dim,
            MAX_SPLITS=triton.next_power_of_2(splits),
        )
        return out

    return decode_attention


def decode_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """The Triton kernel; same contract as `decode_attention_reference`. Inputs need a unit last stride."""
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return _decode_op()(query, key, value, mask, float(scale))
