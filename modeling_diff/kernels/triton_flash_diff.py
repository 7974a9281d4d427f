"""Triton flash-diff attention: both softmax maps of every differential head in one pass over K and V.

A differential head i has two maps over the same keys and values (DIFF Transformer, arXiv 2410.05258, Eq. 1):
O1 = softmax(Q1 K1^T s) V and O2 = softmax(Q2 K2^T s) V. V1 splits the key head into K1|K2 (each DQK wide)
and V is 2*DQK wide; V2 uses one key head for both maps (K1 = K2, SPLIT_K false) and V is DQK wide. A program
of the forward owns BLOCK_M queries of one head, loads each K/V tile once for both maps, keeps two online
softmaxes (flash attention 2), and ends with the combine (`triton_combine.v1_combine_rows`: lambda and the
subln RMSNorm; V2: the per-token noise weight) so only the combined head output is written.

Backward (the combine's backward, `triton_combine`, first turns grad y into g = dO1, with dO2 = -mu g, and
the D terms): dP2 = -mu dP1 with dP1 = g V^T, so one g V^T serves both maps, and
dV = (P1 - mu P2)^T g is one product. `_flash_diff_bwd_dkdv` owns a K/V tile and walks the queries of every
head of its GQA group; `_flash_diff_bwd_dq` owns a query tile and walks the keys.

Softmax in base 2 (scores times log2 e); a query with no visible key gets output 0 and logsumexp +1e30 (so its
probabilities recompute as 0 in the backward). Query i sees keys n <= i + offset (`masks.py`: 0 without a
mask, transformers' top-left causal; S - L with one); a bool mask (B or 1, 1, L, S), True = visible, is
applied on top (padding).

Imported only when triton is installed (see `kernels/flash_diff.py` for the reference, autograd and dispatch).
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401 (flash_diff.py's launches build them)
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error

from ._triton import TRITON_INTERPRETING
from .triton_combine import v1_combine_rows


@triton.jit
def _visible(Mask, b, m, n, m_ok, n_ok, offset, smb, sml, sms, HAS_MASK: tl.constexpr):
    """(len(m), len(n)) bool: causal (query m sits at position m + offset), in range, and the mask's verdict."""
    allowed = (n[None, :] <= (m + offset)[:, None]) & n_ok[None, :] & m_ok[:, None]
    if HAS_MASK:
        seen = tl.load(Mask + b * smb + m[:, None] * sml + n[None, :] * sms, mask=allowed, other=0)
        allowed = allowed & (seen != 0)
    return allowed


@triton.jit
def _query_program(H, L, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program over a query block of one (batch, head): (block, b, head, kv head, query rows, rows < L).
    Grid (B * H, query blocks), blocks last to first: under causal masking the later blocks see the most keys, and
    with the block on the slower axis every head's longest programs start before any shorter one (longest first,
    so that no long program starts in the launch's last wave)."""
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    head = pid_bh % H
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return pid_m, b, head, head // GROUP, m, m < L


@triton.jit
def _load_rows(pointers, ok, other, ROWS_CHECKED: tl.constexpr):
    """tl.load of query rows: `other` where not ok; not ROWS_CHECKED, no mask at all (every row is below L)."""
    if ROWS_CHECKED:
        return tl.load(pointers, mask=ok, other=other)
    return tl.load(pointers)


@triton.jit
def _load_query_pair(Q, b, head, m, m_ok, sqb, sql, sqh, sqp, DQK: tl.constexpr, TRANSPOSED: tl.constexpr,
                     ROWS_CHECKED: tl.constexpr = True):
    """Q1, Q2 of the rows m of one head: (rows, DQK), or (DQK, rows) if TRANSPOSED; 0 beyond L. Not
    ROWS_CHECKED: the caller knows every row is below L (no mask, no selects)."""
    dqk = tl.arange(0, DQK)
    if TRANSPOSED:
        q_ptr = Q + b * sqb + head * sqh + m[None, :] * sql + dqk[:, None]
        ok = m_ok[None, :]
    else:
        q_ptr = Q + b * sqb + head * sqh + m[:, None] * sql + dqk[None, :]
        ok = m_ok[:, None]
    return _load_rows(q_ptr, ok, 0.0, ROWS_CHECKED), _load_rows(q_ptr + sqp, ok, 0.0, ROWS_CHECKED)


@triton.jit
def _softmax_step(s, qk_scale, running_max, running_sum, acc, v):
    """One key tile of an online softmax (base 2): the running max, sum and P V accumulator, rescaled. s: the tile's
    unscaled Q.K (-inf where masked); qk_scale (scale x log2 e) > 0 goes into the exponent's fused multiply-add, and
    the max is of scaled scores (the max of s, scaled: the same number)."""
    new_max = tl.maximum(running_max, tl.max(s, axis=1) * qk_scale)
    p = tl.exp2(s * qk_scale - new_max[:, None])
    alpha = tl.exp2(running_max - new_max)
    return new_max, running_sum * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _key_tile(Kd, Vd, b, kvh, n0, n_ok, S, DQK: tl.constexpr, DV: tl.constexpr, SPLIT_K: tl.constexpr,
              MASKED: tl.constexpr):
    """K1, K2 (BLOCK_N, DQK) and V (BLOCK_N, DV) of the keys n0 .. n0 + BLOCK_N of one (batch, kv head), through the
    tensor descriptors (TMA) of K (B*S, H_kv * KD) and V (B*S, H_kv * DV): a token's heads side by side in a row.
    A MASKED tile's keys beyond S are the next sequence's rows: zeroed, so that nothing of them (a NaN) reaches this
    one's products. On the H200 (one layer, the ~1.1B shapes), V2's forward and dQ kernels took 1.13-1.15 /
    1.16-1.17 ms a step at 8K this way against 1.21 / 1.19 with pointer loads, and 18.6 / 19.4 against 20.0 / 19.8
    at 32K; V1's 0.74-0.79 / 0.75 against 0.78 / 0.73 at 8K and 0.27 / 0.24 against 0.27 / 0.23 at 2K. The dK/dV
    kernel's query tiles through TMA took 11% longer (V2 at 8K: 2.18 against 1.96 ms), so it loads through pointers
    (benchmarks/results_h200_tma_descriptors.md)."""
    KD: tl.constexpr = 2 * DQK if SPLIT_K else DQK
    row = b * S + n0
    k1 = Kd.load([row, kvh * KD])
    k2 = Kd.load([row, kvh * KD + DQK]) if SPLIT_K else k1
    v = Vd.load([row, kvh * DV])
    if MASKED:
        k1 = tl.where(n_ok[:, None], k1, 0.0)
        k2 = tl.where(n_ok[:, None], k2, 0.0) if SPLIT_K else k1
        v = tl.where(n_ok[:, None], v, 0.0)
    return k1, k2, v


@triton.jit
def _fwd_tile(
    q1, q2, Kd, Vd, kvh, n0, m, m_ok, offset, S, Mask, b, smb, sml, sms, qk_scale,
    max1, sum1, acc1, max2, sum2, acc2,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
    MASKED: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """Both maps over the keys n0 .. n0 + BLOCK_N. Not MASKED: every query sees every key of the tile."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < S
    k1, k2, v = _key_tile(Kd, Vd, b, kvh, n0, n_ok, S, DQK, DV, SPLIT_K, MASKED)
    s1 = tl.dot(q1, tl.trans(k1))
    s2 = tl.dot(q2, tl.trans(k2))
    if MASKED:
        allowed = _visible(Mask, b, m, n, m_ok, n_ok, offset, smb, sml, sms, HAS_MASK)
        s1 = tl.where(allowed, s1, float("-inf"))
        s2 = tl.where(allowed, s2, float("-inf"))
    max1, sum1, acc1 = _softmax_step(s1, qk_scale, max1, sum1, acc1, v)
    max2, sum2, acc2 = _softmax_step(s2, qk_scale, max2, sum2, acc2, v)
    return max1, sum1, acc1, max2, sum2, acc2


@triton.jit(do_not_specialize=["KEYS_BUCKET"])
def _flash_diff_fwd(
    Q, Kd, Vd, Mask, Mu, NormW, Y, Pairs, Lse, Rstd,
    sqb, sql, sqh, sqp, smb, sml, sms,
    H, L, S, offset, eps, norm_scale, KEYS_BUCKET,
    SCALE: tl.constexpr, GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, SPLIT_K: tl.constexpr,
    V1: tl.constexpr, HAS_MASK: tl.constexpr, SAVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Q (B, L, H, 2, DQK) by strides; Kd, Vd: descriptors of K (B*S, H_kv * (2*DQK or DQK)) and V (B*S, H_kv * DV),
    # blocks of (BLOCK_N, DQK or DV) (`_key_tile`); Y (B*L*H, DV);
    # SAVE (training): Pairs (B*L*H, 2, DV) = (O1, O2), Lse (B*L*H, 2), Rstd (B*L*H,) for the backward.
    pid_m, b, head, kvh, m, m_ok = _query_program(H, L, GROUP, BLOCK_M)
    dv = tl.arange(0, DV)
    q1, q2 = _load_query_pair(Q, b, head, m, m_ok, sqb, sql, sqh, sqp, DQK, False)
    qk_scale = SCALE * 1.4426950408889634

    # A finite "minus infinity" for the running max: fully masked tiles stay NaN-free.
    max1 = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    max2 = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    sum1 = tl.zeros((BLOCK_M,), tl.float32)
    sum2 = tl.zeros((BLOCK_M,), tl.float32)
    acc1 = tl.zeros((BLOCK_M, DV), tl.float32)
    acc2 = tl.zeros((BLOCK_M, DV), tl.float32)
    hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + offset)  # causal: no key beyond the block's last query
    if HAS_MASK:  # every tile masked
        for n0 in range(0, hi, BLOCK_N):
            max1, sum1, acc1, max2, sum2, acc2 = _fwd_tile(
                q1, q2, Kd, Vd, kvh, n0, m, m_ok, offset, S, Mask, b, smb, sml, sms, qk_scale,
                max1, sum1, acc1, max2, sum2, acc2, DQK, DV, BLOCK_N, SPLIT_K, True, HAS_MASK,
            )
    else:
        full = (pid_m * BLOCK_M + offset + 1) // BLOCK_N * BLOCK_N  # keys [0, full): seen by every query
        for n0 in range(0, full, BLOCK_N):
            max1, sum1, acc1, max2, sum2, acc2 = _fwd_tile(
                q1, q2, Kd, Vd, kvh, n0, m, m_ok, offset, S, Mask, b, smb, sml, sms, qk_scale,
                max1, sum1, acc1, max2, sum2, acc2, DQK, DV, BLOCK_N, SPLIT_K, False, HAS_MASK,
            )
        for n0 in range(full, hi, BLOCK_N):  # the diagonal
            max1, sum1, acc1, max2, sum2, acc2 = _fwd_tile(
                q1, q2, Kd, Vd, kvh, n0, m, m_ok, offset, S, Mask, b, smb, sml, sms, qk_scale,
                max1, sum1, acc1, max2, sum2, acc2, DQK, DV, BLOCK_N, SPLIT_K, True, HAS_MASK,
            )

    o1 = acc1 / tl.where(sum1 > 0, sum1, 1.0)[:, None]
    o2 = acc2 / tl.where(sum2 > 0, sum2, 1.0)[:, None]
    rows = (b * L + m) * H + head  # row of (B, L, H)
    if V1:
        lam = tl.load(Mu).to(tl.float32)
        y, rstd = v1_combine_rows(o1, o2, lam, tl.load(NormW + dv).to(tl.float32), eps, norm_scale, DV)
    else:
        weight = tl.load(Mu + rows, mask=m_ok, other=0.0).to(tl.float32)
        y = o1 - weight[:, None] * o2
    tl.store(Y + rows[:, None] * DV + dv[None, :], y.to(Y.dtype.element_ty), mask=m_ok[:, None])
    if SAVE:
        pair_ptr = Pairs + rows[:, None] * (2 * DV) + dv[None, :]
        tl.store(pair_ptr, o1.to(Pairs.dtype.element_ty), mask=m_ok[:, None])
        tl.store(pair_ptr + DV, o2.to(Pairs.dtype.element_ty), mask=m_ok[:, None])
        tl.store(Lse + rows * 2, tl.where(sum1 > 0, max1 + tl.log2(tl.where(sum1 > 0, sum1, 1.0)), 1.0e30), mask=m_ok)
        tl.store(Lse + rows * 2 + 1, tl.where(sum2 > 0, max2 + tl.log2(tl.where(sum2 > 0, sum2, 1.0)), 1.0e30),
                 mask=m_ok)
        if V1:
            tl.store(Rstd + rows, rstd, mask=m_ok)


@triton.jit
def _query_rows(Q, G, Terms, b, head, m, m_ok, H, L, sqb, sql, sqh, sqp, lam,
                DQK: tl.constexpr, DV: tl.constexpr, V1: tl.constexpr, TRANSPOSED: tl.constexpr,
                ROWS_CHECKED: tl.constexpr = True):
    """What the backward reads per query row: Q1, Q2 ((DQK, rows) if TRANSPOSED), g = dO1, the logsumexp and
    D term of each map, and mu (V1: lam; V2: the row's noise weight). Terms (B, H, 4 or 5, L): each row term of a
    head contiguous along L, so that a tile's rows are one contiguous load per term. Rows beyond L get logsumexp
    +1e30, so their probabilities recompute as 0. Not ROWS_CHECKED: the caller knows every row is below L, and the
    loads take no mask (in the dK/dV kernel's query loop the masks' compares and selects were an eighth of the loop's
    instructions on sm_90a)."""
    rows = (b * L + m) * H + head
    q1, q2 = _load_query_pair(Q, b, head, m, m_ok, sqb, sql, sqh, sqp, DQK, TRANSPOSED, ROWS_CHECKED)
    go = _load_rows(G + rows[:, None] * DV + tl.arange(0, DV)[None, :], m_ok[:, None], 0.0, ROWS_CHECKED)
    terms = Terms + (b * H + head) * (4 if V1 else 5) * L + m
    lse1 = _load_rows(terms, m_ok, 1.0e30, ROWS_CHECKED)
    lse2 = _load_rows(terms + L, m_ok, 1.0e30, ROWS_CHECKED)
    delta1 = _load_rows(terms + 2 * L, m_ok, 0.0, ROWS_CHECKED)
    delta2 = _load_rows(terms + 3 * L, m_ok, 0.0, ROWS_CHECKED)
    if V1:
        mu = tl.zeros_like(lse1) + lam
    else:
        mu = _load_rows(terms + 4 * L, m_ok, 0.0, ROWS_CHECKED)
    return q1, q2, go, lse1, lse2, delta1, delta2, mu


@triton.jit
def _dkdv_tile(
    Q, G, Terms, Mask, k1, k2, v, n, n_ok, m0, b, head, H, L, offset, qk_scale, lam,
    sqb, sql, sqh, sqp, smb, sml, sms, dk1, dk2, dv_acc,
    DQK: tl.constexpr, DV: tl.constexpr, V1: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, HAS_MASK: tl.constexpr, WHOLE_TILES: tl.constexpr,
):
    """The queries m0 .. m0 + BLOCK_M of one head against the program's keys: their share of dK and dV (without
    SPLIT_K, both maps' shares of dK in dk1: one key head; dk2 is left as it is). Not MASKED: every query of the
    tile sees every key; WHOLE_TILES: L is a multiple of BLOCK_M, so the rows of an unmasked tile need no check.
    V1's tile has the keys as its rows. V2's has the queries, as the dQ kernel's (and FlashAttention-3's): its five
    row terms then broadcast along rows. Each is the faster for its mode, at 8K on the H200: V2 1.977 ms against
    2.142, V1 1.231 against 1.783 (results_h200_dkdv_orientation.md). V2 accumulates dV^T = g^T (P1 - mu P2) and
    dK^T = Q^T dS (dk1, dk2, dv_acc: (DQK or DV, BLOCK_N)), so that P and dS are the products' second operands, which
    the tensor cores read from shared memory as stored, in place of transposed tiles loaded back into registers
    (dV^T and dK^T at 8K: 1.930 ms against 2.017-2.025, results_h200_dkdv_transposed_accumulators.md). Operands
    named `_t` have the keys as rows: (BLOCK_N, BLOCK_M)."""
    m = m0 + tl.arange(0, BLOCK_M)
    m_ok = m < L
    q1, q2, go, lse1, lse2, delta1, delta2, mu = _query_rows(
        Q, G, Terms, b, head, m, m_ok, H, L, sqb, sql, sqh, sqp, lam, DQK, DV, V1, V1, MASKED or not WHOLE_TILES
    )  # V1: q1, q2 (DQK, BLOCK_M); V2: (BLOCK_M, DQK)
    if V1:
        p1_t = tl.exp2(tl.dot(k1, q1) * qk_scale - lse1[None, :])
        p2_t = tl.exp2(tl.dot(k2, q2) * qk_scale - lse2[None, :])
        if MASKED:
            allowed_t = tl.trans(_visible(Mask, b, m, n, m_ok, n_ok, offset, smb, sml, sms, HAS_MASK))
            p1_t = tl.where(allowed_t, p1_t, 0.0)
            p2_t = tl.where(allowed_t, p2_t, 0.0)
        dv_acc += tl.dot((p1_t - p2_t * mu[None, :]).to(go.dtype), go)  # (P1 - mu P2)^T g
        dp_t = tl.dot(v, tl.trans(go))  # (g V^T)^T = dP1^T; dP2 = -mu dP1
        ds1_t = p1_t * (dp_t - delta1[None, :])
        ds2_t = p2_t * (-mu[None, :] * dp_t - delta2[None, :])
        dk1 += tl.dot(ds1_t.to(q1.dtype), tl.trans(q1))  # dS1^T Q1
        if SPLIT_K:
            dk2 += tl.dot(ds2_t.to(q2.dtype), tl.trans(q2))
        else:
            dk1 += tl.dot(ds2_t.to(q2.dtype), tl.trans(q2))
    else:  # dV^T and dK^T: P and dS are the products' second operands, read from shared memory as they are
        p1 = tl.exp2(tl.dot(q1, tl.trans(k1)) * qk_scale - lse1[:, None])  # (BLOCK_M, BLOCK_N)
        p2 = tl.exp2(tl.dot(q2, tl.trans(k2)) * qk_scale - lse2[:, None])
        if MASKED:
            allowed = _visible(Mask, b, m, n, m_ok, n_ok, offset, smb, sml, sms, HAS_MASK)
            p1 = tl.where(allowed, p1, 0.0)
            p2 = tl.where(allowed, p2, 0.0)
        dv_acc += tl.dot(tl.trans(go), (p1 - p2 * mu[:, None]).to(go.dtype))  # g^T (P1 - mu P2)
        dp = tl.dot(go, tl.trans(v))
        ds1 = (p1 * (dp - delta1[:, None])).to(q1.dtype)
        ds2 = (p2 * (-mu[:, None] * dp - delta2[:, None])).to(q2.dtype)
        dk1 += tl.dot(tl.trans(q1), ds1)  # Q1^T dS1
        if SPLIT_K:
            dk2 += tl.dot(tl.trans(q2), ds2)
        else:  # one accumulator fewer: 3.8% faster on V2's dK/dV at 8K (results_h200_dkdv_sweep_v2.md)
            dk1 += tl.dot(tl.trans(q2), ds2)
    return dk1, dk2, dv_acc


@triton.jit(do_not_specialize=["KEYS_BUCKET"])
def _flash_diff_bwd_dkdv(
    Q, K, V, Mask, Mu, G, Terms, DK, DVout,
    sqb, sql, sqh, sqp, skb, skh, sks, svb, svh, svs, smb, sml, sms, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
    H, L, S, offset, KEYS_BUCKET,
    SCALE: tl.constexpr, GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, SPLIT_K: tl.constexpr,
    V1: tl.constexpr, HAS_MASK: tl.constexpr, WHOLE_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # G (B*L*H, DV) = dO1; Terms (B, H, 4 or 5, L) as `_query_rows` reads them. A program: BLOCK_N keys of one
    # (batch, kv head) and the queries of every head of its GQA group; it writes their dK and dV. Grid (B * H_kv, key
    # blocks): the first key blocks, which the most queries see, start first (as in `_query_program`). WHOLE_TILES:
    # L is a multiple of every candidate BLOCK_M (DKDV_WHOLE_TILES_OF), so no query tile reaches past L.
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = pid_bh // (H // GROUP)
    kvh = pid_bh % (H // GROUP)
    n_start = pid_n * BLOCK_N
    n = n_start + tl.arange(0, BLOCK_N)
    n_ok = n < S
    dqk = tl.arange(0, DQK)
    dv = tl.arange(0, DV)
    k_ptr = K + b * skb + kvh * skh + n[:, None] * sks + dqk[None, :]
    k1 = tl.load(k_ptr, mask=n_ok[:, None], other=0.0)  # (BLOCK_N, DQK)
    k2 = tl.load(k_ptr + DQK, mask=n_ok[:, None], other=0.0) if SPLIT_K else k1
    v = tl.load(V + b * svb + kvh * svh + n[:, None] * svs + dv[None, :], mask=n_ok[:, None], other=0.0)
    qk_scale = SCALE * 1.4426950408889634
    lam = tl.load(Mu).to(tl.float32) if V1 else 0.0

    if V1:  # keys as rows (see _dkdv_tile)
        dk1 = tl.zeros((BLOCK_N, DQK), tl.float32)
        dk2 = tl.zeros((BLOCK_N, DQK), tl.float32)
        dv_acc = tl.zeros((BLOCK_N, DV), tl.float32)
    else:  # dK^T, dV^T: keys as columns, transposed once at the store
        dk1 = tl.zeros((DQK, BLOCK_N), tl.float32)
        dk2 = tl.zeros((DQK, BLOCK_N), tl.float32)
        dv_acc = tl.zeros((DV, BLOCK_N), tl.float32)
    lo = tl.maximum(n_start - offset, 0) // BLOCK_M * BLOCK_M  # causal: earlier queries see none of these keys
    # queries from `full` on see every key of the tile (a tile reaching past S has none such)
    full = tl.minimum(tl.maximum((n_start + BLOCK_N - 1 - offset + BLOCK_M - 1) // BLOCK_M * BLOCK_M, lo), L)
    for g in range(0, GROUP):
        head = kvh * GROUP + g
        if HAS_MASK:  # every tile masked
            for m0 in range(lo, L, BLOCK_M):
                dk1, dk2, dv_acc = _dkdv_tile(
                    Q, G, Terms, Mask, k1, k2, v, n, n_ok, m0, b, head, H, L, offset, qk_scale, lam,
                    sqb, sql, sqh, sqp, smb, sml, sms, dk1, dk2, dv_acc, DQK, DV, V1, SPLIT_K, BLOCK_M, True,
                    HAS_MASK, WHOLE_TILES,
                )
        else:
            for m0 in range(lo, full, BLOCK_M):  # the diagonal
                dk1, dk2, dv_acc = _dkdv_tile(
                    Q, G, Terms, Mask, k1, k2, v, n, n_ok, m0, b, head, H, L, offset, qk_scale, lam,
                    sqb, sql, sqh, sqp, smb, sml, sms, dk1, dk2, dv_acc, DQK, DV, V1, SPLIT_K, BLOCK_M, True,
                    HAS_MASK, WHOLE_TILES,
                )
            for m0 in range(full, L, BLOCK_M):
                dk1, dk2, dv_acc = _dkdv_tile(
                    Q, G, Terms, Mask, k1, k2, v, n, n_ok, m0, b, head, H, L, offset, qk_scale, lam,
                    sqb, sql, sqh, sqp, smb, sml, sms, dk1, dk2, dv_acc, DQK, DV, V1, SPLIT_K, BLOCK_M, False,
                    HAS_MASK, WHOLE_TILES,
                )

    if not V1:
        dk1, dk2, dv_acc = tl.trans(dk1), tl.trans(dk2), tl.trans(dv_acc)
    dk_ptr = DK + b * sdkb + kvh * sdkh + n[:, None] * sdks + dqk[None, :]
    tl.store(dk_ptr, (dk1 * SCALE).to(DK.dtype.element_ty), mask=n_ok[:, None])
    if SPLIT_K:
        tl.store(dk_ptr + DQK, (dk2 * SCALE).to(DK.dtype.element_ty), mask=n_ok[:, None])
    tl.store(DVout + b * sdvb + kvh * sdvh + n[:, None] * sdvs + dv[None, :], dv_acc.to(DVout.dtype.element_ty),
             mask=n_ok[:, None])


@triton.jit
def _dq_tile(
    q1, q2, go, lse1, lse2, delta1, delta2, mu, Kd, Vd, kvh, n0, m, m_ok, offset, S, Mask, b,
    smb, sml, sms, qk_scale, dq1, dq2,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, MASKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """The program's queries against the keys n0 .. n0 + BLOCK_N: their share of dQ1, dQ2."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < S
    k1, k2, v = _key_tile(Kd, Vd, b, kvh, n0, n_ok, S, DQK, DV, SPLIT_K, MASKED)
    p1 = tl.exp2(tl.dot(q1, tl.trans(k1)) * qk_scale - lse1[:, None])
    p2 = tl.exp2(tl.dot(q2, tl.trans(k2)) * qk_scale - lse2[:, None])
    if MASKED:
        allowed = _visible(Mask, b, m, n, m_ok, n_ok, offset, smb, sml, sms, HAS_MASK)
        p1 = tl.where(allowed, p1, 0.0)
        p2 = tl.where(allowed, p2, 0.0)
    dp = tl.dot(go, tl.trans(v))  # dP1 = g V^T; dP2 = -mu dP1
    ds1 = p1 * (dp - delta1[:, None])
    ds2 = p2 * (-mu[:, None] * dp - delta2[:, None])
    dq1 += tl.dot(ds1.to(k1.dtype), k1)
    dq2 += tl.dot(ds2.to(k2.dtype), k2)
    return dq1, dq2


@triton.jit(do_not_specialize=["KEYS_BUCKET"])
def _flash_diff_bwd_dq(
    Q, Kd, Vd, Mask, Mu, G, Terms, DQ,
    sqb, sql, sqh, sqp, smb, sml, sms, sdqb, sdql, sdqh, sdqp,
    H, L, S, offset, KEYS_BUCKET,
    SCALE: tl.constexpr, GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, SPLIT_K: tl.constexpr,
    V1: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # A program: BLOCK_M queries of one (batch, head); walks the keys they see.
    pid_m, b, head, kvh, m, m_ok = _query_program(H, L, GROUP, BLOCK_M)
    dqk = tl.arange(0, DQK)
    lam = tl.load(Mu).to(tl.float32) if V1 else 0.0
    q1, q2, go, lse1, lse2, delta1, delta2, mu = _query_rows(
        Q, G, Terms, b, head, m, m_ok, H, L, sqb, sql, sqh, sqp, lam, DQK, DV, V1, False
    )
    qk_scale = SCALE * 1.4426950408889634

    dq1 = tl.zeros((BLOCK_M, DQK), tl.float32)
    dq2 = tl.zeros((BLOCK_M, DQK), tl.float32)
    hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + offset)
    if HAS_MASK:  # every tile masked
        for n0 in range(0, hi, BLOCK_N):
            dq1, dq2 = _dq_tile(
                q1, q2, go, lse1, lse2, delta1, delta2, mu, Kd, Vd, kvh, n0, m, m_ok, offset, S, Mask, b,
                smb, sml, sms, qk_scale, dq1, dq2, DQK, DV, BLOCK_N, SPLIT_K, True, HAS_MASK,
            )
    else:
        full = (pid_m * BLOCK_M + offset + 1) // BLOCK_N * BLOCK_N
        for n0 in range(0, full, BLOCK_N):
            dq1, dq2 = _dq_tile(
                q1, q2, go, lse1, lse2, delta1, delta2, mu, Kd, Vd, kvh, n0, m, m_ok, offset, S, Mask, b,
                smb, sml, sms, qk_scale, dq1, dq2, DQK, DV, BLOCK_N, SPLIT_K, False, HAS_MASK,
            )
        for n0 in range(full, hi, BLOCK_N):  # the diagonal
            dq1, dq2 = _dq_tile(
                q1, q2, go, lse1, lse2, delta1, delta2, mu, Kd, Vd, kvh, n0, m, m_ok, offset, S, Mask, b,
                smb, sml, sms, qk_scale, dq1, dq2, DQK, DV, BLOCK_N, SPLIT_K, True, HAS_MASK,
            )

    dq_ptr = DQ + b * sdqb + head * sdqh + m[:, None] * sdql + dqk[None, :]
    tl.store(dq_ptr, (dq1 * SCALE).to(DQ.dtype.element_ty), mask=m_ok[:, None])
    tl.store(dq_ptr + sdqp, (dq2 * SCALE).to(DQ.dtype.element_ty), mask=m_ok[:, None])


def tile_descriptors(args: dict) -> None:
    """The key and value descriptors among a launch's `args` (Kd, Vd) get the config's BLOCK_N keys as their block's
    rows: autotuning's pre-hook, before each config it launches; under the interpreter, the caller's."""
    for name in ("Kd", "Vd"):
        if name in args:
            args[name].block_shape[0] = args["BLOCK_N"]


def _tuned(kernel, configs, key):
    """(kernel, launch options): autotuned over `configs` on a GPU; under the interpreter, the first config."""
    if TRITON_INTERPRETING:
        return kernel, configs[0]
    tuned = [
        triton.Config({k: v for k, v in c.items() if k.startswith("BLOCK")}, num_warps=c["num_warps"],
                      num_stages=c["num_stages"], pre_hook=tile_descriptors)
        for c in configs
    ]
    return triton.autotune(configs=tuned, key=key)(kernel), {}


def keys_bucket(keys: int) -> int:
    """The autotuners' KEYS_BUCKET of a launch against `keys` keys, ceil(log2(keys)) // 2: keys in (512, 2K] share
    one, (2K, 8K] the next, then (8K, 32K] and (32K, 128K]. Long sequences get picks of their own, while a process that
    meets many lengths (prefills, bench.py's rows) tunes a few times, not once a length. The kernels do not read it.
    On the H200 V1's forward picked 64 x 64 (queries x keys) / 4 warps at 2K and 8K and 128 x 64 / 8 warps at 32K,
    and V1's 32K training step took 1091 ms with 32K's picks against 1101 ms with 2K's (benchmarks/RESULTS.md);
    V2's picks were the same at every length."""
    return (max(keys, 1) - 1).bit_length() // 2


_KEY = ["DQK", "DV", "SPLIT_K", "HAS_MASK", "KEYS_BUCKET"]
if TRITON_INTERPRETING:  # tiny shapes on CPU: tl.dot wants 16 x 16 at least
    _FWD = _DKDV = _DQ = [dict(BLOCK_M=16, BLOCK_N=16)]
else:  # H100/H200-class GPUs; two fp32 accumulators of DV per row bound the tile sizes
    _FWD = [
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    ]
    _DKDV = [
        dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
    ]
    _DQ = [
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2),
    ]


flash_diff_fwd, FWD_FIXED = _tuned(_flash_diff_fwd, _FWD, _KEY + ["SAVE"])
DKDV_WHOLE_TILES_OF = max(c["BLOCK_M"] for c in _DKDV)  # lengths whose query tiles are whole at every candidate
flash_diff_bwd_dkdv, DKDV_FIXED = _tuned(_flash_diff_bwd_dkdv, _DKDV, _KEY + ["GROUP"])
flash_diff_bwd_dq, DQ_FIXED = _tuned(_flash_diff_bwd_dq, _DQ, _KEY)
