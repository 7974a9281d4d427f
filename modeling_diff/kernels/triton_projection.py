"""Triton projections of a few rows (decoding steps): several Linear maps of one input in one launch, and one Linear
map split along its input width.

Imported only when triton is installed (see `kernels/projection.py` for the reference, the dispatch and the block
sizes). x (M, K) with M a decoding step's tokens (batch x new tokens, at most 64), weights (N_i, K) row-major as
nn.Linear keeps them. A program owns BLOCK_N rows of one weight and every row of x; it walks K (or its part of K)
in BLOCK_K steps and multiplies on the tensor cores (x padded to BLOCK_M >= 16 rows: the step is bound by the
weight's bytes, not by arithmetic). Under PDL a program reads its first weight tile before it waits for x
(`triton_launch.py`):

    projections        y_i = x W_i^T for up to four weights (q, k, v and V2's lambda_proj) in one output buffer,
                       each weight's programs in turn, each y_i (M, N_i) a contiguous block of it; with SPLIT > 1
                       the float32 partials P_s = x[:, K_s] W_i[:, K_s]^T for SPLIT equal parts K_s of K (more
                       programs than the weights' row blocks: o_proj's 2048 rows are 32 blocks for 132 SMs), and
                       where SUMMED their sum in the same launch: the last of a row block's programs to finish
                       (a ticket each, an atomic add) sums its block's parts, rounds them to the dtype (F.linear's
                       output), adds a residual where ADD (residual + F.linear(...), rounded again) and applies
                       RoPE to q's and k's heads where HALF > 0; where CACHED it also stores the second and third
                       weights' sums (k and v) into a StaticCache layer at its next positions
    gated_projection   y = silu(x W_g^T) * (x W_u^T), each rounded to the dtype as LlamaMLP rounds them
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error

from .triton_launch import let_dependents_start, wait_for_inputs
from .triton_rope import rotated
from .triton_swiglu import _silu


@triton.jit
def _row_block_products(X, W, V, M, row0, N, k0, K: tl.constexpr, K_PART: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    """float32 (BLOCK_M, BLOCK_N) blocks of x W^T and, where GATED, of x V^T, for the weights' rows row0 + [0,
    BLOCK_N) and columns k0 + [0, K_PART); K_PART a multiple of BLOCK_K. Both weights are read in the same loop
    (twice the bytes in flight). Under PDL (steps of at most 32 tokens) the first tiles are read before the wait for
    x: one more tile in shared memory, which the smallest x leaves room for."""
    rows = tl.arange(0, BLOCK_M)
    cols = row0 + tl.arange(0, BLOCK_N)
    ks = k0 + tl.arange(0, BLOCK_K)
    x_ptrs = X + rows[:, None] * K + ks[None, :]
    w_offsets = cols[:, None].to(tl.int64) * K + ks[None, :]
    x_ok = rows[:, None] < M
    w_ok = cols[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_v = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if PDL:  # compile-time branches (no scope of their own): the first tiles of the weights before the wait for x
        let_dependents_start(PDL)
        w = tl.load(W + w_offsets, mask=w_ok, other=0.0)
        if GATED:
            v = tl.load(V + w_offsets, mask=w_ok, other=0.0)
        wait_for_inputs(PDL)
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            acc_v = tl.dot(x, tl.trans(v), acc_v)
    for k in range(BLOCK_K if PDL else 0, K_PART, BLOCK_K):
        x = tl.load(x_ptrs + k, mask=x_ok, other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(W + w_offsets + k, mask=w_ok, other=0.0)), acc)
        if GATED:
            acc_v = tl.dot(x, tl.trans(tl.load(V + w_offsets + k, mask=w_ok, other=0.0)), acc_v)
    return acc, acc_v


@triton.jit
def _store_rows(Y, y, M, row0, N, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # y (BLOCK_M, BLOCK_N) -> Y[:M, row0:row0 + BLOCK_N] of a row-major (M, stride) output, columns < N
    rows = tl.arange(0, BLOCK_M)
    cols = row0 + tl.arange(0, BLOCK_N)
    tl.store(Y + rows[:, None] * stride + cols[None, :], y.to(Y.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


# the tokens of a step change with the batch, the cache's length with the model: one compiled kernel for all
@triton.jit(do_not_specialize=["M", "L", "max_len"])
def _projections(X, W0, W1, W2, W3, Y, M, N0, N1, N2, N3, Out, Res, Cos, Sin, Tickets, L, scb, scl,
                 Keys, Values, Length, max_len, skb, skh, sks, svb, svh, svs, key_width, value_width,
                 K: tl.constexpr, SPLIT: tl.constexpr, SUMMED: tl.constexpr, ADD: tl.constexpr, HALF: tl.constexpr,
                 CACHED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    # Y (M x (N0 + N1 + N2 + N3) elements) = the blocks X W0^T (M, N0), X W1^T (M, N1), ... one after another, each
    # row-major: the first cdiv(N0, BLOCK_N) programs compute the first block, the next ones the second, ...; an
    # unused weight has N_i = 0. Contiguous blocks, not column blocks of one (M, sum) matrix: a DynamicCache
    # concatenates v (and k) with its cache, and torch.cat's fast kernel needs contiguous inputs. K (the input width)
    # is a constant of the compiled kernel: two per model (hidden and MLP widths). SPLIT > 1: program (j, s)
    # computes the float32 partial product over K's part s into Y's part s, (SPLIT, M x (N0 + ... + N3)) in all;
    # where SUMMED, the last of a row block's SPLIT programs to finish (a ticket each: `_finish_row_block`) writes
    # Out, the sum (+ Res where ADD, with RoPE on the first two weights' heads where HALF > 0), in the same launch;
    # where CACHED also the second's and third's (k, v) into Keys and Values (B, H_kv, max_len, width) at the
    # positions Length + l of token (b, l), columns c at head c // width, c % width (`_store_into_cache`).
    pid = tl.program_id(0)
    part = tl.program_id(1)
    end0 = tl.cdiv(N0, BLOCK_N)
    end1 = end0 + tl.cdiv(N1, BLOCK_N)
    end2 = end1 + tl.cdiv(N2, BLOCK_N)
    if pid < end0:
        W, N, row0, col0 = W0, N0, pid * BLOCK_N, 0
    elif pid < end1:
        W, N, row0, col0 = W1, N1, (pid - end0) * BLOCK_N, N0
    elif pid < end2:
        W, N, row0, col0 = W2, N2, (pid - end1) * BLOCK_N, N0 + N1
    else:
        W, N, row0, col0 = W3, N3, (pid - end2) * BLOCK_N, N0 + N1 + N2
    acc, _ = _row_block_products(X, W, W, M, row0, N, part * (K // SPLIT), K, K // SPLIT, BLOCK_M, BLOCK_N, BLOCK_K,
                                 False, PDL)
    nt = N0 + N1 + N2 + N3
    _store_rows(Y + part * M * nt + M * col0, acc, M, row0, N, N, BLOCK_M, BLOCK_N)
    if SUMMED:
        tl.debug_barrier()  # every thread's partial stored before the ticket's release (CUTLASS's split-K semaphore)
        if tl.atomic_add(Tickets + pid, 1, sem="acq_rel") == SPLIT - 1:
            y = _finish_row_block(Y, Out, Res, Cos, Sin, M, L, row0, N, nt, col0, pid < end1, scb, scl, SPLIT, ADD,
                                  HALF, BLOCK_M, BLOCK_N)
            if CACHED:
                if (pid >= end0) & (pid < end1):
                    _store_into_cache(Keys, Length, y, M, L, row0, N, max_len, skb, skh, sks, key_width, BLOCK_M,
                                      BLOCK_N)
                elif (pid >= end1) & (pid < end2):
                    _store_into_cache(Values, Length, y, M, L, row0, N, max_len, svb, svh, svs, value_width, BLOCK_M,
                                      BLOCK_N)
            tl.store(Tickets + pid, 0)


@triton.jit
def _summed_partials(P, at, ok, stride, SPLIT: tl.constexpr, dtype):
    # sum of the SPLIT float32 partials at offsets `at` (part s at P + s stride), rounded to dtype, as float32. Past
    # L1 (.cg): the partials are other programs' stores of this launch
    y = tl.load(P + at, mask=ok, other=0.0, cache_modifier=".cg")
    for s in range(1, SPLIT):
        y += tl.load(P + s * stride + at, mask=ok, other=0.0, cache_modifier=".cg")
    return y.to(dtype).to(tl.float32)


@triton.jit
def _finish_row_block(P, Out, Res, Cos, Sin, M, L, row0, N, nt, col0, rotate, scb, scl, SPLIT: tl.constexpr,
               ADD: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Out[:M, row0:row0 + BLOCK_N] of the weight block at M col0 = the sum of its SPLIT partials rounded to Out's
    # dtype (F.linear's output); + Res (M, N) rounded again where ADD (residual + F.linear(...)); where HALF > 0 and
    # `rotate` (q's and k's blocks), RoPE on every 2 HALF wide head (`triton_rope.py`'s arithmetic: float32, rounded
    # once) with the token's cos and sin (B or 1, L, 2 HALF; batch stride scb, 0 = shared): the block holds whole
    # heads, so a column's partner is a column of this block. -> the block (BLOCK_M, BLOCK_N) as stored, in Out's dtype
    rows = tl.arange(0, BLOCK_M)
    cols = row0 + tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    at = M * col0 + rows[:, None] * N + cols[None, :]
    dtype = Out.dtype.element_ty
    y = _summed_partials(P, at, ok, M * nt, SPLIT, dtype)
    if ADD:
        y = (y + tl.load(Res + at, mask=ok, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
    if HALF > 0:
        j = cols % (2 * HALF)  # the column within its head
        partner = tl.where(j < HALF, cols + HALF, cols - HALF)  # rotate_half's other column
        spun = ok & rotate
        at_partner = M * col0 + rows[:, None] * N + partner[None, :]
        y_partner = _summed_partials(P, at_partner, spun, M * nt, SPLIT, dtype)
        cs = (rows // L)[:, None] * scb + (rows % L)[:, None] * scl + j[None, :]
        cos = tl.load(Cos + cs, mask=spun, other=1.0).to(tl.float32)
        sin = tl.load(Sin + cs, mask=spun, other=0.0).to(tl.float32)
        y = tl.where(spun, rotated(y, y_partner, cos, sin, tl.where(j < HALF, -1.0, 1.0)[None, :]), y)
    y = y.to(dtype)
    tl.store(Out + at, y, mask=ok)
    return y


@triton.jit
def _store_into_cache(Cache, Length, y, M, L, row0, N, max_len, scb, sch, scs, width,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # y (BLOCK_M, BLOCK_N): tokens b L + l x columns row0.. of k's or v's output -> Cache[b, c // width, t + l,
    # c % width] (B, H_kv, max_len, width), t the layer's length (int64, on the device; not advanced here); positions
    # outside [0, max_len) are not written (StaticLayer.update's index_copy_ fails there)
    rows = tl.arange(0, BLOCK_M)
    cols = row0 + tl.arange(0, BLOCK_N)
    pos = tl.load(Length) + rows % L
    at = (rows // L)[:, None] * scb + (cols // width)[None, :] * sch + pos[:, None] * scs + (cols % width)[None, :]
    written = (pos >= 0) & (pos < max_len)
    tl.store(Cache + at, y, mask=(rows[:, None] < M) & (cols[None, :] < N) & written[:, None])


@triton.jit(do_not_specialize=["M"])
def _gated_projection(X, WG, WU, Y, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_N
    gate, up = _row_block_products(X, WG, WU, M, row0, N, 0, K, K, BLOCK_M, BLOCK_N, BLOCK_K, True, PDL)
    dtype = Y.dtype.element_ty
    silu = _silu(gate.to(dtype).to(tl.float32))[0].to(dtype).to(tl.float32)
    _store_rows(Y, silu * up.to(dtype).to(tl.float32), M, row0, N, N, BLOCK_M, BLOCK_N)
