"""Triton kernels for the differential combine that follows the attention call (forward and backward).

Imported only when triton is installed (see `kernels/combine.py`, which holds the PyTorch references and the
autograd wiring). Rows are independent: a program handles BLOCK_R rows of one head's output.

V1 (per row, D = 2d):  x = a1 - lam * a2,  n = x * rsqrt(mean(x^2) + eps),  y = scale * w * n
V2 (per row, D = d):   y = a_signal - w_row * a_noise

and V1's lambda from its four vectors, forward and backward, one program each.
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error


# The coefficients of the differential term, for kernels that compute them where a decoding step needs them
# (six or more small launches each on the host otherwise). Their references are the modules' own methods.


@triton.jit
def differential_lambda(LambdaQ1, LambdaK1, LambdaQ2, LambdaK2, lambda_init, D: tl.constexpr):
    """V1's lambda from its four D-long vectors, fp32 (`diff_attention.DifferentialLambda`)."""
    d = tl.arange(0, D)
    dot_1 = tl.sum(tl.load(LambdaQ1 + d).to(tl.float32) * tl.load(LambdaK1 + d).to(tl.float32), axis=0)
    dot_2 = tl.sum(tl.load(LambdaQ2 + d).to(tl.float32) * tl.load(LambdaK2 + d).to(tl.float32), axis=0)
    return tl.exp(dot_1) - tl.exp(dot_2) + lambda_init


@triton.jit
def _differential_lambda_fwd(LambdaQ1, LambdaK1, LambdaQ2, LambdaK2, Lam, lambda_init, D: tl.constexpr):
    tl.store(Lam, differential_lambda(LambdaQ1, LambdaK1, LambdaQ2, LambdaK2, lambda_init, D))


@triton.jit
def _differential_lambda_bwd(
    LambdaQ1, LambdaK1, LambdaQ2, LambdaK2, GradLam, GradQ1, GradK1, GradQ2, GradK2, D: tl.constexpr,
):
    # lambda = exp(q1 . k1) - exp(q2 . k2) + lambda_init: dq1 = g exp(q1 . k1) k1, dk1 = g exp(q1 . k1) q1,
    # dq2 = -g exp(q2 . k2) k2, dk2 = -g exp(q2 . k2) q2 (float32, stored in the vectors' dtype).
    d = tl.arange(0, D)
    q1 = tl.load(LambdaQ1 + d).to(tl.float32)
    k1 = tl.load(LambdaK1 + d).to(tl.float32)
    q2 = tl.load(LambdaQ2 + d).to(tl.float32)
    k2 = tl.load(LambdaK2 + d).to(tl.float32)
    grad = tl.load(GradLam).to(tl.float32)
    g1 = grad * tl.exp(tl.sum(q1 * k1, axis=0))
    g2 = -grad * tl.exp(tl.sum(q2 * k2, axis=0))
    tl.store(GradQ1 + d, (g1 * k1).to(GradQ1.dtype.element_ty))
    tl.store(GradK1 + d, (g1 * q1).to(GradK1.dtype.element_ty))
    tl.store(GradQ2 + d, (g2 * k2).to(GradQ2.dtype.element_ty))
    tl.store(GradK2 + d, (g2 * q2).to(GradK2.dtype.element_ty))


@triton.jit
def anneal_fraction(AnnealStep, anneal_steps, ANNEALED: tl.constexpr):
    """t / T, t from the `AnnealingStep` buffer; 1 when annealing is off (`diff_attention.anneal_fraction`)."""
    if ANNEALED:
        return tl.load(AnnealStep).to(tl.float32) / anneal_steps
    else:
        return 1.0


@triton.jit
def dex_lambda(LambdaLearn, fraction, lambda_init):
    """DEX's lambda(t) = (1 - a) (t/T) lambda_init + a lambda_learn, a = min(1, t/T) (`diff_attention.DexLambda`)."""
    a = tl.minimum(fraction, 1.0)
    return (1 - a) * fraction * lambda_init + a * tl.load(LambdaLearn).to(tl.float32)


@triton.jit
def v1_combine_rows(a1, a2, lam, w, eps, scale, D: tl.constexpr):
    """(rows, D) fp32 pair -> (y, rstd): the V1 combine of each row (also the flash-diff kernel's epilogue)."""
    x = a1 - lam * a2
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    return x * rstd[:, None] * w[None, :] * scale, rstd


@triton.jit
def _v1_combine_fwd(A, Lam, W, Y, Rstd, R, eps, scale, D: tl.constexpr, BLOCK_R: tl.constexpr):
    # A: (R, 2, D) contiguous (pair of maps per row); Y: (R, D); Rstd: (R,) fp32, saved for backward.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    ok = rows[:, None] < R
    a1 = tl.load(A + rows[:, None] * (2 * D) + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    a2 = tl.load(A + rows[:, None] * (2 * D) + D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    lam = tl.load(Lam).to(tl.float32)
    w = tl.load(W + cols).to(tl.float32)
    y, rstd = v1_combine_rows(a1, a2, lam, w, eps, scale, D)
    tl.store(Y + rows[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(Rstd + rows, rstd, mask=rows < R)


@triton.jit
def _v1_combine_bwd(
    A, Lam, W, Rstd, DY, DA, DWpart, DLampart, Delta, R, scale,
    D: tl.constexpr, BLOCK_R: tl.constexpr, FOR_FLASH: tl.constexpr,
):
    # RMSNorm backward: dx = rstd * (dn - n * mean(dn * n)), dn = dy * scale * w; da1 = dx, da2 = -lam dx.
    # Per-program partial sums of dw (D,) and dlam go to DWpart / DLampart; the caller sums them.
    # FOR_FLASH (the flash-diff kernel's backward): DA is (R, D) and holds dx only (da2 = -lam dx is implied),
    # and Delta (R, 2) gets rowsum(da1 * a1), rowsum(da2 * a2), the D terms of the two maps' softmax backward.
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    ok = rows[:, None] < R
    a1 = tl.load(A + rows[:, None] * (2 * D) + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    a2 = tl.load(A + rows[:, None] * (2 * D) + D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    lam = tl.load(Lam).to(tl.float32)
    w = tl.load(W + cols).to(tl.float32)
    rstd = tl.load(Rstd + rows, mask=rows < R, other=0.0)
    n = (a1 - lam * a2) * rstd[:, None]
    dn = dy * scale * w[None, :]
    dx = rstd[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
    if FOR_FLASH:
        tl.store(DA + rows[:, None] * D + cols[None, :], dx.to(DA.dtype.element_ty), mask=ok)
        tl.store(Delta + rows * 2, tl.sum(dx * a1, axis=1), mask=rows < R)
        tl.store(Delta + rows * 2 + 1, -lam * tl.sum(dx * a2, axis=1), mask=rows < R)
    else:
        tl.store(DA + rows[:, None] * (2 * D) + cols[None, :], dx.to(DA.dtype.element_ty), mask=ok)
        tl.store(DA + rows[:, None] * (2 * D) + D + cols[None, :], (-lam * dx).to(DA.dtype.element_ty), mask=ok)
    tl.store(DWpart + pid * D + cols, tl.sum(dy * scale * n, axis=0))
    tl.store(DLampart + pid, -tl.sum(tl.sum(dx * a2, axis=1), axis=0))


@triton.jit
def _v2_combine_fwd(A, Wt, Y, R, D: tl.constexpr, BLOCK_R: tl.constexpr):
    # A: (R, 2, D) contiguous (signal, noise); Wt: (R,) noise weight per row; Y: (R, D).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    ok = rows[:, None] < R
    signal = tl.load(A + rows[:, None] * (2 * D) + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    noise = tl.load(A + rows[:, None] * (2 * D) + D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(Wt + rows, mask=rows < R, other=0.0).to(tl.float32)
    tl.store(Y + rows[:, None] * D + cols[None, :], (signal - w[:, None] * noise).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _v2_combine_bwd(A, Wt, DY, DA, DWt, Delta, R, D: tl.constexpr, BLOCK_R: tl.constexpr, FOR_FLASH: tl.constexpr):
    # d signal = dy, d noise = -w dy, d w = -sum(dy * noise) per row. FOR_FLASH: as in _v1_combine_bwd (DA is
    # not written: d signal is dy itself).
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D)
    ok = rows[:, None] < R
    noise = tl.load(A + rows[:, None] * (2 * D) + D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(Wt + rows, mask=rows < R, other=0.0).to(tl.float32)
    if FOR_FLASH:
        signal = tl.load(A + rows[:, None] * (2 * D) + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(Delta + rows * 2, tl.sum(dy * signal, axis=1), mask=rows < R)
        tl.store(Delta + rows * 2 + 1, -w * tl.sum(dy * noise, axis=1), mask=rows < R)
    else:
        tl.store(DA + rows[:, None] * (2 * D) + cols[None, :], dy.to(DA.dtype.element_ty), mask=ok)
        tl.store(DA + rows[:, None] * (2 * D) + D + cols[None, :], (-w[:, None] * dy).to(DA.dtype.element_ty), mask=ok)
    tl.store(DWt + rows, (-tl.sum(dy * noise, axis=1)).to(DWt.dtype.element_ty), mask=rows < R)


# DEX's operator folded into o_proj's weight (`combine.dex_folded_projection`): W (HIDDEN, H * D) bf16 / fp16 / fp32,
# head h's columns W_h (HIDDEN, D); f_D's weight F (D, D); lambda_h = lambda(t) mask_h rounded to W's dtype, and
# M_h = lambda_h F in W's dtype, as the reference's operator lambda_h f_D(I) = lambda_h F^T is (f_D(x) = x F^T).
# W'_h = W_h - W_h M_h, accumulated in fp32 and rounded once.


@triton.jit
def _dex_head_operator(F, LambdaLearn, HeadMask, fraction, lambda_init, head, D: tl.constexpr):
    """(M_h (D, D) in F's dtype, lambda_h rounded to F's dtype as fp32, F as fp32); fraction = t / T
    (`anneal_fraction`)."""
    lam = dex_lambda(LambdaLearn, fraction, lambda_init) * tl.load(HeadMask + head).to(tl.float32)
    lam = lam.to(F.dtype.element_ty).to(tl.float32)
    d = tl.arange(0, D)
    operator = tl.load(F + d[:, None] * D + d[None, :]).to(tl.float32)
    return (lam * operator).to(F.dtype.element_ty), lam, operator


@triton.jit
def _dex_fold_fwd(W, F, LambdaLearn, HeadMask, AnnealStep, Out, HIDDEN, anneal_steps, lambda_init,
                  ANNEALED: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                  PRECISION: tl.constexpr):
    # program (row block, head): BLOCK_R rows of W_h -> W'_h
    head = tl.program_id(1)
    fraction = anneal_fraction(AnnealStep, anneal_steps, ANNEALED)
    operator, _, _ = _dex_head_operator(F, LambdaLearn, HeadMask, fraction, lambda_init, head, D)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offsets = rows[:, None] * (H * D) + head * D + tl.arange(0, D)[None, :]
    ok = rows[:, None] < HIDDEN
    w = tl.load(W + offsets, mask=ok, other=0.0)
    folded = w.to(tl.float32) - tl.dot(w, operator, input_precision=PRECISION)
    tl.store(Out + offsets, folded.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _dex_fold_bwd(W, F, LambdaLearn, HeadMask, AnnealStep, DOut, DW, DFpart, DLambdaPart, HIDDEN, rows_per_split,
                  anneal_steps, lambda_init, ANNEALED: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                  BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    # program (head, split): the rows [split * rows_per_split, ...) of head h (rows_per_split a multiple of BLOCK_R):
    # dW_h = dW'_h - dW'_h M_h^T; and of this split's part of dM_h = -W_h^T dW'_h (D, D), fp32, its terms of
    # dF = sum_h lambda_h dM_h into DFpart[split, h] and of sum_h mask_h <dM_h, F> into DLambdaPart[split, h]
    head, split = tl.program_id(0), tl.program_id(1)
    fraction = anneal_fraction(AnnealStep, anneal_steps, ANNEALED)
    operator, lam, f = _dex_head_operator(F, LambdaLearn, HeadMask, fraction, lambda_init, head, D)
    d = tl.arange(0, D)
    grad_operator = tl.zeros((D, D), dtype=tl.float32)
    first = split * rows_per_split
    for start in range(first, tl.minimum(first + rows_per_split, HIDDEN), BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        offsets = rows[:, None] * (H * D) + head * D + d[None, :]
        ok = rows[:, None] < HIDDEN
        dout = tl.load(DOut + offsets, mask=ok, other=0.0)
        w = tl.load(W + offsets, mask=ok, other=0.0)
        dw = dout.to(tl.float32) - tl.dot(dout, tl.trans(operator), input_precision=PRECISION)
        tl.store(DW + offsets, dw.to(DW.dtype.element_ty), mask=ok)
        grad_operator -= tl.dot(tl.trans(w), dout, input_precision=PRECISION)
    part = split * H + head
    tl.store(DFpart + (part * D + d[:, None]) * D + d[None, :], lam * grad_operator)
    mask = tl.load(HeadMask + head).to(tl.float32)
    tl.store(DLambdaPart + part, mask * tl.sum(tl.sum(grad_operator * f, axis=1), axis=0))


@triton.jit
def _dex_fold_bwd_reduce(DFpart, DLambdaPart, AnnealStep, DF, DLambdaLearn, anneal_steps, PARTS,
                         ANNEALED: tl.constexpr, D: tl.constexpr, PARTS_POW2: tl.constexpr, BLOCK: tl.constexpr):
    # program p: BLOCK elements of dF, the sum of the PARTS parts (one load of all of them: no serial loop);
    # program 0 also d lambda_learn = a * the sum of its parts, a = min(1, t/T) (lambda(t)'s derivative)
    parts = tl.arange(0, PARTS_POW2)
    columns = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = parts[:, None] < PARTS
    grad_f = tl.sum(tl.load(DFpart + parts[:, None] * (D * D) + columns[None, :], mask=ok, other=0.0), axis=0)
    tl.store(DF + columns, grad_f.to(DF.dtype.element_ty))
    if tl.program_id(0) == 0:
        a = tl.minimum(anneal_fraction(AnnealStep, anneal_steps, ANNEALED), 1.0)
        grad_lambda = tl.sum(tl.load(DLambdaPart + parts, mask=parts < PARTS, other=0.0), axis=0)
        tl.store(DLambdaLearn, (a * grad_lambda).to(DLambdaLearn.dtype.element_ty))
