"""Triton RMSNorm over the last dim (forward and backward), the arithmetic of transformers' LlamaRMSNorm.

Imported only when triton is installed (see `kernels/rmsnorm.py` for the reference, the dispatch and autograd).

    forward   r = rsqrt(mean(x^2) + eps),  n = x r rounded to x's dtype,  y = w n
              (x = res + update rounded to the dtype, written too, where a residual add comes first)
    backward  dx = r (g - n mean(g n)), g = dy w (n in float32);  dw = sum over rows of dy n
              (plus the gradient of the sum x, where the sum is used beyond the norm: the residual stream's);
              dw in two launches: partial sums over blocks of rows, then their sum in the weight's dtype
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error

from .triton_launch import let_dependents_start, wait_for_inputs


@triton.jit(do_not_specialize=["R"])  # the row count (tokens) changes every call: one compiled kernel for all
def _rms_norm_fwd(X, W, Y, Rstd, Res, Sum, R, N, eps, BLOCK_N: tl.constexpr, SAVE: tl.constexpr,
                  ADD: tl.constexpr, PDL: tl.constexpr):
    # X, Y: (R, N) contiguous; one program per row; Rstd (R,) float32, saved for the backward where SAVE. Where ADD,
    # the norm is of x + res rounded to the dtype (a residual add: Res (R, N)), which is written to Sum (R, N).
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    let_dependents_start(PDL)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    wait_for_inputs(PDL)
    x = tl.load(X + row * N + cols, mask=ok, other=0.0)
    if ADD:
        res = tl.load(Res + row * N + cols, mask=ok, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) + res).to(X.dtype.element_ty)
        tl.store(Sum + row * N + cols, x, mask=ok)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    n = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * N + cols, (w * n).to(Y.dtype.element_ty), mask=ok)
    if SAVE:
        tl.store(Rstd + row, rstd)


@triton.jit(do_not_specialize=["R"])
def _rms_norm_bwd(X, W, Rstd, DY, DSum, DX, DWpart, R, N, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                  ADD: tl.constexpr):
    # ROWS rows per program; each program writes its partial dw (N,) in float32 to DWpart, the caller sums them.
    # Where ADD, DSum (R, N) is x's gradient from its other uses (the residual stream's), added to dx before rounding.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        live = ok & (row < R)
        x = tl.load(X + row * N + cols, mask=live, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * N + cols, mask=live, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row, mask=row < R, other=0.0)
        n = x * rstd
        dw += dy * n.to(X.dtype.element_ty).to(tl.float32)
        g = dy * w
        dx = rstd * (g - n * (tl.sum(g * n, axis=0) / N))
        if ADD:
            dx += tl.load(DSum + row * N + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=live)
    tl.store(DWpart + pid * N + cols, dw, mask=ok)


@triton.jit(do_not_specialize=["P"])
def _rms_norm_dw_sum(DWpart, DW, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # DWpart (P, N) float32, the backward's partial dw -> DW (N,) = their sum in DW's dtype; programs of BLOCK_N
    # columns. One launch where torch's column sum and the cast to the weight's dtype were two.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    dw = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, P, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        dw += tl.sum(tl.load(DWpart + parts[:, None] * N + cols[None, :],
                             mask=(parts[:, None] < P) & ok[None, :], other=0.0), axis=0)
    tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=ok)
