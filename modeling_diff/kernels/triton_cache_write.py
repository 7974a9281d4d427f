"""Triton: a decoding step's keys and values written into a StaticCache layer, and its length advanced, in one launch.

Imported only when triton is installed (see `kernels/cache_write.py` for the reference, transformers'
`StaticLayer.update`, and the dispatch). A program owns one new token (b, l) and BLOCK_H kv heads; it reads the
layer's length t (`cumulative_length`, on the device) and stores the token's key and value at position t + l of
`keys` and `values` (B, H_kv, max_cache_len, D). Positions outside [0, max_cache_len) are not written
(transformers' `index_copy_` fails there). The length becomes t + L once every program has read it: each program takes a ticket
(an atomic add, acquire-release), and the program with the last ticket stores t + L and puts the ticket back to 0.
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
def _copy_heads(X, Out, b, l, pos, heads, ok, sxb, sxh, sxl, sob, soh, sos, D: tl.constexpr):
    # X (B, H, L, D) by strides -> Out[b, heads, pos, :] of (B, H, S, D), the last dims contiguous
    cols = tl.arange(0, D)
    row = tl.load(X + b * sxb + heads[:, None] * sxh + l * sxl + cols[None, :], mask=ok[:, None], other=0.0)
    tl.store(Out + b * sob + heads[:, None] * soh + pos * sos + cols[None, :], row, mask=ok[:, None])


@triton.jit(do_not_specialize=["L", "MAX_LEN"])  # the step's tokens and the cache length: one kernel for all
def _static_cache_write(
    K, V, Keys, Values, Length, Ticket,
    skb, skh, skl, svb, svh, svl, sKb, sKh, sKs, sVb, sVh, sVs,
    L, H, MAX_LEN, DK: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    let_dependents_start(PDL)
    wait_for_inputs(PDL)  # the keys and values are the kernels' before
    t = tl.program_id(0)
    b = t // L
    l = t % L
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    start = tl.load(Length)  # int64: the tokens the layer holds before this step
    pos = start + l
    ok = (heads < H) & (pos >= 0) & (pos < MAX_LEN)  # a length out of range writes nothing
    _copy_heads(K, Keys, b, l, pos, heads, ok, skb, skh, skl, sKb, sKh, sKs, DK)
    _copy_heads(V, Values, b, l, pos, heads, ok, svb, svh, svl, sVb, sVh, sVs, DV)
    # every program has read the length before its ticket (acquire-release): the last one advances it
    programs = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(Ticket, 1) == programs - 1:
        tl.store(Length, start + L)
        tl.store(Ticket, 0)
