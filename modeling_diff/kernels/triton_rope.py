"""Triton RoPE: the rotation of every head of a token in one pass (forward, and its transpose for backward).

Imported only when triton is installed (see `kernels/rope.py` for the reference, the dispatch and autograd).
A program owns one token and BLOCK_H heads of the query or the key (both in one launch), loads the token's cos
and sin and rotates the two halves:

    forward    o1 = x1 c1 - x2 s1,   o2 = x2 c2 + x1 s2        (x * cos + rotate_half(x) * sin)
    transpose  o1 = x1 c1 + x2 s2,   o2 = x2 c2 - x1 s1        (the gradient: g * cos + rotate_half^T(g * sin))

And the cos and sin of a decoding step's positions in one launch (`_rope_cos_sin`), where transformers' rotary
embedding issues about eight kernels.
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error

from .triton_launch import let_dependents_start, wait_for_inputs


@triton.jit
def rotated(x, partner, cos, sin, sign):
    """RoPE of one column x of a head (float32): x cos + rotate_half(x) sin, where rotate_half(x) at x's column is
    sign * partner, partner the column HALF away in the same head (sign -1 in the first half, +1 in the second; the
    transpose swaps the signs and the halves' sines)."""
    return x * cos + sign * partner * sin


@triton.jit
def _rotate_heads(X, Out, Cos, Sin, b, l, heads, H, sxb, sxl, sxh, sob, sol, soh, scb, scl,
                  HALF: tl.constexpr, TRANSPOSE: tl.constexpr):
    # X, Out: (B, L, H, 2 * HALF), last dim contiguous; Cos, Sin: (B or 1, L, 2 * HALF), batch stride scb (0 = shared).
    cols = tl.arange(0, HALF)
    ok = heads[:, None] < H
    cs = b * scb + l * scl + cols
    c1 = tl.load(Cos + cs).to(tl.float32)[None, :]
    c2 = tl.load(Cos + cs + HALF).to(tl.float32)[None, :]
    s1 = tl.load(Sin + cs).to(tl.float32)[None, :]
    s2 = tl.load(Sin + cs + HALF).to(tl.float32)[None, :]
    x_ptr = X + b * sxb + l * sxl + heads[:, None] * sxh + cols[None, :]
    x1 = tl.load(x_ptr, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    if TRANSPOSE:
        o1 = rotated(x1, x2, c1, s2, 1.0)
        o2 = rotated(x2, x1, c2, s1, -1.0)
    else:
        o1 = rotated(x1, x2, c1, s1, -1.0)
        o2 = rotated(x2, x1, c2, s2, 1.0)
    o_ptr = Out + b * sob + l * sol + heads[:, None] * soh + cols[None, :]
    tl.store(o_ptr, o1.to(Out.dtype.element_ty), mask=ok)
    tl.store(o_ptr + HALF, o2.to(Out.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["L"])  # the token count changes every call: one compiled kernel for all
def _rope(
    Q, K, Cos, Sin, OutQ, OutK, sqb, sql, sqh, skb, skl, skh, soqb, soql, soqh, sokb, sokl, sokh, scb, scl,
    L, HQ, HK, HALF: tl.constexpr, BLOCK_H: tl.constexpr, TRANSPOSE: tl.constexpr, PDL: tl.constexpr,
):
    # The query and the key in one launch: blocks of BLOCK_H heads, the query's first, then the key's.
    let_dependents_start(PDL)
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    b = t // L
    l = t % L
    block = tl.program_id(1)
    query_blocks = tl.cdiv(HQ, BLOCK_H)
    if block < query_blocks:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(Q, OutQ, Cos, Sin, b, l, heads, HQ, sqb, sql, sqh, soqb, soql, soqh, scb, scl, HALF, TRANSPOSE)
    else:
        heads = (block - query_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(K, OutK, Cos, Sin, b, l, heads, HK, skb, skl, skh, sokb, sokl, sokh, scb, scl, HALF, TRANSPOSE)


@triton.jit(do_not_specialize=["T"])
def _rope_cos_sin(Pos, InvFreq, Cos, Sin, scaling, T, HALF: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    # Cos, Sin (T, 2 HALF) of the T positions Pos (int) and the HALF frequencies InvFreq (float32, or the model's
    # dtype after `model.to(dtype)`), as transformers' rotary embedding computes them: float32 position x frequency
    # (the frequencies upcast), each half the same angles, cos and sin times `scaling`, rounded once to the output's
    # dtype.
    let_dependents_start(PDL)
    wait_for_inputs(PDL)  # the positions may be the kernel before's
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, HALF)
    ok = t[:, None] < T
    frequencies = tl.load(InvFreq + cols).to(tl.float32)
    angle = tl.load(Pos + t, mask=t < T, other=0).to(tl.float32)[:, None] * frequencies[None, :]
    cos = (tl.cos(angle) * scaling).to(Cos.dtype.element_ty)
    sin = (tl.sin(angle) * scaling).to(Sin.dtype.element_ty)
    at = t[:, None] * (2 * HALF) + cols[None, :]
    tl.store(Cos + at, cos, mask=ok)
    tl.store(Cos + at + HALF, cos, mask=ok)
    tl.store(Sin + at, sin, mask=ok)
    tl.store(Sin + at + HALF, sin, mask=ok)
