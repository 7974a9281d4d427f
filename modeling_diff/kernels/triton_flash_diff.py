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
probabilities recompute as 0 in the backward). Causal with the L queries the last L of S positions; a bool
mask (B or 1, 1, L, S), True = visible, is applied on top (padding).

Imported only when triton is installed (see `kernels/flash_diff.py` for the reference, autograd and dispatch).
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
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
def _flash_diff_fwd(
    Q, K, V, Mask, Mu, NormW, Y, Pairs, Lse, Rstd,
    sqb, sql, sqh, sqp, skb, skh, sks, svb, svh, svs, smb, sml, sms,
    H, L, S, eps, norm_scale,
    SCALE: tl.constexpr, GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, SPLIT_K: tl.constexpr, V1: tl.constexpr,
    HAS_MASK: tl.constexpr, SAVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    S_STATIC: tl.constexpr = 0, L_STATIC: tl.constexpr = 0,
):
    # Q (B, L, H, 2, DQK) by strides; K (B, H_kv, S, 2*DQK or DQK); V (B, H_kv, S, DV); Y (B*L*H, DV);
    # SAVE (training): Pairs (B*L*H, 2, DV) = (O1, O2), Lse (B*L*H, 2), Rstd (B*L*H,) for the backward.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    head = pid_bh % H
    kvh = head // GROUP
    offset = S - L
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < L
    dqk = tl.arange(0, DQK)
    dv = tl.arange(0, DV)
    q_ptr = Q + b * sqb + head * sqh + m[:, None] * sql + dqk[None, :]
    q1 = tl.load(q_ptr, mask=m_ok[:, None], other=0.0)
    q2 = tl.load(q_ptr + sqp, mask=m_ok[:, None], other=0.0)
    k_ptr = K + b * skb + kvh * skh
    v_ptr = V + b * svb + kvh * svh
    qk_scale = SCALE * 1.4426950408889634

    # A finite "minus infinity" for the running max: fully masked tiles stay NaN-free.
    max1 = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    max2 = tl.full((BLOCK_M,), -1.0e30, tl.float32)
    sum1 = tl.zeros((BLOCK_M,), tl.float32)
    sum2 = tl.zeros((BLOCK_M,), tl.float32)
    acc1 = tl.zeros((BLOCK_M, DV), tl.float32)
    acc2 = tl.zeros((BLOCK_M, DV), tl.float32)
    hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + offset)  # causal: no key beyond the block's last query
    # S_STATIC: the interpreter, whose loop bounds must be compile-time (its program ids are arrays)
    for n0 in range(0, S_STATIC if S_STATIC > 0 else hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < S
        k1 = tl.load(k_ptr + n[None, :] * sks + dqk[:, None], mask=n_ok[None, :], other=0.0)  # (DQK, BLOCK_N)
        if SPLIT_K:
            k2 = tl.load(k_ptr + n[None, :] * sks + DQK + dqk[:, None], mask=n_ok[None, :], other=0.0)
        else:
            k2 = k1
        v = tl.load(v_ptr + n[:, None] * svs + dv[None, :], mask=n_ok[:, None], other=0.0)  # (BLOCK_N, DV)
        allowed = _visible(Mask, b, m, n, m_ok, n_ok, offset, smb, sml, sms, HAS_MASK)

        s1 = tl.where(allowed, tl.dot(q1, k1) * qk_scale, float("-inf"))
        new1 = tl.maximum(max1, tl.max(s1, axis=1))
        p1 = tl.exp2(s1 - new1[:, None])
        alpha1 = tl.exp2(max1 - new1)
        sum1 = sum1 * alpha1 + tl.sum(p1, axis=1)
        acc1 = acc1 * alpha1[:, None] + tl.dot(p1.to(v.dtype), v)
        max1 = new1

        s2 = tl.where(allowed, tl.dot(q2, k2) * qk_scale, float("-inf"))
        new2 = tl.maximum(max2, tl.max(s2, axis=1))
        p2 = tl.exp2(s2 - new2[:, None])
        alpha2 = tl.exp2(max2 - new2)
        sum2 = sum2 * alpha2 + tl.sum(p2, axis=1)
        acc2 = acc2 * alpha2[:, None] + tl.dot(p2.to(v.dtype), v)
        max2 = new2

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
        tl.store(Pairs + rows[:, None] * (2 * DV) + dv[None, :], o1.to(Pairs.dtype.element_ty), mask=m_ok[:, None])
        tl.store(Pairs + rows[:, None] * (2 * DV) + DV + dv[None, :], o2.to(Pairs.dtype.element_ty), mask=m_ok[:, None])
        tl.store(Lse + rows * 2, tl.where(sum1 > 0, max1 + tl.log2(tl.where(sum1 > 0, sum1, 1.0)), 1.0e30), mask=m_ok)
        tl.store(Lse + rows * 2 + 1, tl.where(sum2 > 0, max2 + tl.log2(tl.where(sum2 > 0, sum2, 1.0)), 1.0e30), mask=m_ok)
        if V1:
            tl.store(Rstd + rows, rstd, mask=m_ok)


@triton.jit
def _flash_diff_bwd_dkdv(
    Q, K, V, Mask, Mu, G, Lse, Delta, DK, DVout,
    sqb, sql, sqh, sqp, skb, skh, sks, svb, svh, svs, smb, sml, sms, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
    H, L, S,
    SCALE: tl.constexpr, GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, SPLIT_K: tl.constexpr, V1: tl.constexpr,
    HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    S_STATIC: tl.constexpr = 0, L_STATIC: tl.constexpr = 0,
):
    # G (B*L*H, DV) = dO1; Lse, Delta (B*L*H, 2). A program: BLOCK_N keys of one (batch, kv head).
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    kv_heads = H // GROUP
    b = pid_bh // kv_heads
    kvh = pid_bh % kv_heads
    offset = S - L
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < S
    dqk = tl.arange(0, DQK)
    dv = tl.arange(0, DV)
    k_ptr = K + b * skb + kvh * skh + n[:, None] * sks + dqk[None, :]
    k1 = tl.load(k_ptr, mask=n_ok[:, None], other=0.0)  # (BLOCK_N, DQK)
    if SPLIT_K:
        k2 = tl.load(k_ptr + DQK, mask=n_ok[:, None], other=0.0)
    else:
        k2 = k1
    v = tl.load(V + b * svb + kvh * svh + n[:, None] * svs + dv[None, :], mask=n_ok[:, None], other=0.0)
    qk_scale = SCALE * 1.4426950408889634
    if V1:
        lam = tl.load(Mu).to(tl.float32)

    dk1 = tl.zeros((BLOCK_N, DQK), tl.float32)
    dk2 = tl.zeros((BLOCK_N, DQK), tl.float32)
    dv_acc = tl.zeros((BLOCK_N, DV), tl.float32)
    lo = tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M * BLOCK_M  # causal: earlier queries see none of it
    for g in range(0, GROUP):
        head = kvh * GROUP + g
        for m0 in range(0 if L_STATIC > 0 else lo, L_STATIC if L_STATIC > 0 else L, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            m_ok = m < L
            rows = (b * L + m) * H + head
            q_ptr = Q + b * sqb + head * sqh + m[None, :] * sql + dqk[:, None]
            q1t = tl.load(q_ptr, mask=m_ok[None, :], other=0.0)  # (DQK, BLOCK_M)
            q2t = tl.load(q_ptr + sqp, mask=m_ok[None, :], other=0.0)
            go = tl.load(G + rows[:, None] * DV + dv[None, :], mask=m_ok[:, None], other=0.0)  # (BLOCK_M, DV)
            lse1 = tl.load(Lse + rows * 2, mask=m_ok, other=1.0e30)
            lse2 = tl.load(Lse + rows * 2 + 1, mask=m_ok, other=1.0e30)
            delta1 = tl.load(Delta + rows * 2, mask=m_ok, other=0.0)
            delta2 = tl.load(Delta + rows * 2 + 1, mask=m_ok, other=0.0)
            if V1:
                mu = tl.full((BLOCK_M,), 1.0, tl.float32) * lam
            else:
                mu = tl.load(Mu + rows, mask=m_ok, other=0.0).to(tl.float32)
            allowed_t = tl.trans(_visible(Mask, b, m, n, m_ok, n_ok, offset, smb, sml, sms, HAS_MASK))

            p1t = tl.where(allowed_t, tl.exp2(tl.dot(k1, q1t) * qk_scale - lse1[None, :]), 0.0)  # (BLOCK_N, BLOCK_M)
            p2t = tl.where(allowed_t, tl.exp2(tl.dot(k2, q2t) * qk_scale - lse2[None, :]), 0.0)
            dv_acc += tl.dot((p1t - p2t * mu[None, :]).to(go.dtype), go)  # (P1 - mu P2)^T g
            dpt = tl.dot(v, tl.trans(go))  # (g V^T)^T = dP1^T; dP2 = -mu dP1
            ds1t = p1t * (dpt - delta1[None, :])
            ds2t = p2t * (-mu[None, :] * dpt - delta2[None, :])
            dk1 += tl.dot(ds1t.to(q1t.dtype), tl.trans(q1t))
            dk2 += tl.dot(ds2t.to(q2t.dtype), tl.trans(q2t))

    dk_ptr = DK + b * sdkb + kvh * sdkh + n[:, None] * sdks + dqk[None, :]
    if SPLIT_K:
        tl.store(dk_ptr, (dk1 * SCALE).to(DK.dtype.element_ty), mask=n_ok[:, None])
        tl.store(dk_ptr + DQK, (dk2 * SCALE).to(DK.dtype.element_ty), mask=n_ok[:, None])
    else:
        tl.store(dk_ptr, ((dk1 + dk2) * SCALE).to(DK.dtype.element_ty), mask=n_ok[:, None])
    tl.store(DVout + b * sdvb + kvh * sdvh + n[:, None] * sdvs + dv[None, :], dv_acc.to(DVout.dtype.element_ty),
             mask=n_ok[:, None])


@triton.jit
def _flash_diff_bwd_dq(
    Q, K, V, Mask, Mu, G, Lse, Delta, DQ,
    sqb, sql, sqh, sqp, skb, skh, sks, svb, svh, svs, smb, sml, sms, sdqb, sdql, sdqh, sdqp,
    H, L, S,
    SCALE: tl.constexpr, GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, SPLIT_K: tl.constexpr, V1: tl.constexpr,
    HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    S_STATIC: tl.constexpr = 0, L_STATIC: tl.constexpr = 0,
):
    # A program: BLOCK_M queries of one (batch, head); walks the keys they see.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    head = pid_bh % H
    kvh = head // GROUP
    offset = S - L
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < L
    dqk = tl.arange(0, DQK)
    dv = tl.arange(0, DV)
    rows = (b * L + m) * H + head
    q_ptr = Q + b * sqb + head * sqh + m[:, None] * sql + dqk[None, :]
    q1 = tl.load(q_ptr, mask=m_ok[:, None], other=0.0)
    q2 = tl.load(q_ptr + sqp, mask=m_ok[:, None], other=0.0)
    go = tl.load(G + rows[:, None] * DV + dv[None, :], mask=m_ok[:, None], other=0.0)
    lse1 = tl.load(Lse + rows * 2, mask=m_ok, other=1.0e30)
    lse2 = tl.load(Lse + rows * 2 + 1, mask=m_ok, other=1.0e30)
    delta1 = tl.load(Delta + rows * 2, mask=m_ok, other=0.0)
    delta2 = tl.load(Delta + rows * 2 + 1, mask=m_ok, other=0.0)
    if V1:
        mu = tl.full((BLOCK_M,), 1.0, tl.float32) * tl.load(Mu).to(tl.float32)
    else:
        mu = tl.load(Mu + rows, mask=m_ok, other=0.0).to(tl.float32)
    k_ptr = K + b * skb + kvh * skh
    v_ptr = V + b * svb + kvh * svh
    qk_scale = SCALE * 1.4426950408889634

    dq1 = tl.zeros((BLOCK_M, DQK), tl.float32)
    dq2 = tl.zeros((BLOCK_M, DQK), tl.float32)
    hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + offset)
    for n0 in range(0, S_STATIC if S_STATIC > 0 else hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < S
        k1 = tl.load(k_ptr + n[:, None] * sks + dqk[None, :], mask=n_ok[:, None], other=0.0)  # (BLOCK_N, DQK)
        if SPLIT_K:
            k2 = tl.load(k_ptr + n[:, None] * sks + DQK + dqk[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k2 = k1
        vt = tl.load(v_ptr + n[None, :] * svs + dv[:, None], mask=n_ok[None, :], other=0.0)  # (DV, BLOCK_N)
        allowed = _visible(Mask, b, m, n, m_ok, n_ok, offset, smb, sml, sms, HAS_MASK)
        p1 = tl.where(allowed, tl.exp2(tl.dot(q1, tl.trans(k1)) * qk_scale - lse1[:, None]), 0.0)
        p2 = tl.where(allowed, tl.exp2(tl.dot(q2, tl.trans(k2)) * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(go, vt)  # dP1 = g V^T; dP2 = -mu dP1
        ds1 = p1 * (dp - delta1[:, None])
        ds2 = p2 * (-mu[:, None] * dp - delta2[:, None])
        dq1 += tl.dot(ds1.to(k1.dtype), k1)
        dq2 += tl.dot(ds2.to(k2.dtype), k2)

    dq_ptr = DQ + b * sdqb + head * sdqh + m[:, None] * sdql + dqk[None, :]
    tl.store(dq_ptr, (dq1 * SCALE).to(DQ.dtype.element_ty), mask=m_ok[:, None])
    tl.store(dq_ptr + sdqp, (dq2 * SCALE).to(DQ.dtype.element_ty), mask=m_ok[:, None])


def _tuned(kernel, configs, key):
    """(kernel, launch options): autotuned over `configs` on a GPU; under the interpreter, the first config."""
    if TRITON_INTERPRETING:
        return kernel, configs[0]
    tuned = [
        triton.Config({k: v for k, v in c.items() if k.startswith("BLOCK")}, num_warps=c["num_warps"],
                      num_stages=c["num_stages"])
        for c in configs
    ]
    return triton.autotune(configs=tuned, key=key)(kernel), {}


_KEY = ["DQK", "DV", "SPLIT_K", "HAS_MASK"]
if TRITON_INTERPRETING:  # tiny shapes on CPU: tl.dot wants 16 x 16 at least
    _FWD = _DKDV = _DQ = [dict(BLOCK_M=16, BLOCK_N=16)]
else:  # H100/H200-class GPUs; two fp32 accumulators of DV per row bound the tile sizes
    _FWD = [
        dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
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
flash_diff_bwd_dkdv, DKDV_FIXED = _tuned(_flash_diff_bwd_dkdv, _DKDV, _KEY)
flash_diff_bwd_dq, DQ_FIXED = _tuned(_flash_diff_bwd_dq, _DQ, _KEY)
