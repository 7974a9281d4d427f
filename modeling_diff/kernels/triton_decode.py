"""Triton split-KV attention for decoding steps (few query tokens): each KV-cache entry is read once per step.

A program owns one (batch, kv head) and one chunk of the cached sequence. Its rows are every query of the
kv head's GQA group (G query heads x L tokens), so the K and V tiles it loads serve the whole group; the
chunks run in parallel (flash-decoding) and `_decode_reduce` merges their partial softmaxes.

Imported only when triton is installed (see `kernels/decode.py` for the reference and the dispatch).
"""

import functools

import torch
from torch.library import triton_op, wrap_triton

from ._triton import TRITON_INTERPRETING
from .masks import causal_offset, kernel_mask

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error


# The cache length (and with it the causal offset, the mask's strides and the number of chunks) grows every
# step: not specialized on (Triton would compile a variant whenever one crosses a multiple of 16), so one
# compiled kernel serves a whole generation.
@triton.jit(do_not_specialize=["smb", "sml", "S", "offset", "splits"])
def _decode_partial(
    Q, K, V, Mask, Opart, Mpart, Lpart,
    sqb, sqh, sql, skb, skh, sks, svb, svh, svs, smb, sml, sms,
    H_KV, S, L, offset, splits,
    SCALE: tl.constexpr,  # a compile-time constant: a runtime float would reach Inductor's launch as fp64
    G: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DQ: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    r = tl.arange(0, BLOCK_R)
    g = r // L  # query head within the group
    t = r % L  # query token
    row_ok = r < G * L
    dq = tl.arange(0, DQ)
    dv = tl.arange(0, DV)
    q = tl.load(
        Q + b * sqb + (kvh * G + g)[:, None] * sqh + t[:, None] * sql + dq[None, :], mask=row_ok[:, None], other=0.0
    )
    qk_scale = SCALE * 1.4426950408889634  # softmax in base 2

    # A finite "minus infinity": a chunk whose keys are all masked stays NaN-free.
    m_i = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, DV), tl.float32)
    start = split * CHUNK  # CHUNK: a power of two >= BLOCK_N, so a growing cache recompiles rarely
    for n0 in range(0, CHUNK, BLOCK_N):
        n = start + n0 + tl.arange(0, BLOCK_N)
        n_ok = n < S
        k = tl.load(K + b * skb + kvh * skh + n[None, :] * sks + dq[:, None], mask=n_ok[None, :], other=0.0)
        s = tl.dot(q, k) * qk_scale  # (BLOCK_R, BLOCK_N), fp32
        if HAS_MASK:
            allowed = tl.load(
                Mask + b * smb + t[:, None] * sml + n[None, :] * sms, mask=row_ok[:, None] & n_ok[None, :], other=0
            ) != 0
        else:  # causal (kernels/masks.py)
            allowed = n[None, :] <= (offset + t)[:, None]
        allowed = allowed & n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(V + b * svb + kvh * svh + n[:, None] * svs + dv[None, :], mask=n_ok[:, None], other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    part = pid_bh * splits + split
    tl.store(Opart + (part * BLOCK_R + r)[:, None] * DV + dv[None, :], acc)
    tl.store(Mpart + part * BLOCK_R + r, m_i)
    tl.store(Lpart + part * BLOCK_R + r, l_i)


@triton.jit(do_not_specialize=["splits"])
def _decode_reduce(
    Opart, Mpart, Lpart, Out, sob, sol, soh, H_KV, L, splits,
    G: tl.constexpr, BLOCK_R: tl.constexpr, DV: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    r = tl.arange(0, BLOCK_R)
    dv = tl.arange(0, DV)
    m = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    l_sum = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, DV), tl.float32)
    for split in range(0, MAX_SPLITS):  # MAX_SPLITS: splits rounded up to a power of two
        part = pid_bh * splits + split
        live = split < splits
        m_s = tl.load(Mpart + part * BLOCK_R + r, mask=live, other=-1.0e30)
        l_s = tl.load(Lpart + part * BLOCK_R + r, mask=live, other=0.0)
        o_s = tl.load(Opart + (part * BLOCK_R + r)[:, None] * DV + dv[None, :], mask=live, other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        l_sum = l_sum * alpha + l_s * beta
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # a query with no visible key gets 0
    g = r // L
    t = r % L
    ok = r < G * L
    tl.store(Out + b * sob + t[:, None] * sol + (kvh * G + g)[:, None] * soh + dv[None, :],
             out.to(Out.dtype.element_ty), mask=ok[:, None])


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _traceable(kernel):
    return kernel if TRITON_INTERPRETING else wrap_triton(kernel)


def _plain(kernel):
    return kernel


def decode_attention_kernels(query, key, value, mask, scale: float, launcher=_plain) -> torch.Tensor:
    """The two launches. Called directly in eager mode: the custom op's dispatch costs more than the kernels
    in a CPU-bound decoding step. `launcher` wraps each kernel (for the op: graph capture)."""
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
    mask_arg, mask_strides = kernel_mask(mask, query)
    launcher(_decode_partial)[(batch * kv_heads, splits)](
        query, key, value, mask_arg, out_part, max_part, sum_part,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        *mask_strides,
        kv_heads, kv_length, length, causal_offset(length, kv_length, mask is not None), splits,
        SCALE=scale, G=groups, HAS_MASK=mask is not None, BLOCK_R=block_rows, BLOCK_N=block_n, DQ=q_dim, DV=v_dim, CHUNK=chunk,
    )
    launcher(_decode_reduce)[(batch * kv_heads,)](
        out_part, max_part, sum_part, out, out.stride(0), out.stride(1), out.stride(2),
        kv_heads, length, splits, G=groups, BLOCK_R=block_rows, DV=v_dim, MAX_SPLITS=triton.next_power_of_2(splits),
    )
    return out


# A custom op: torch.compile (fullgraph=True too) keeps it as one node of the graph and runs the kernels.
@triton_op("modeling_diff::decode_attention", mutates_args=())
def decode_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return decode_attention_kernels(query, key, value, mask, scale, launcher=_traceable)
