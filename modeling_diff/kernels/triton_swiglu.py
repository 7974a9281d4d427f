"""Triton SwiGLU activation, forward and a backward that recomputes the activation, with transformers' rounding;
and the same arithmetic in the epilogue of the MLP's products (on GPUs with TMA).

Imported only when triton is installed (see `kernels/swiglu.py` for the reference, the dispatch and autograd).
a = gate(x), b = up(x), elementwise over (tokens x intermediate), s = silu(a) rounded to the dtype as
`ACT2FN["silu"]` returns it:

    forward   c = s b
    backward  db = dc s, ds = dc b (rounded), da = ds sig(a) (1 + a (1 - sig(a))); and c again where it is not kept
              (the MLP's node), from the same loads

`_gate_up_swiglu` computes a = x W_gate^T and b = x W_up^T in one program (two accumulators) and c from them before
they leave it; `_down_grad_swiglu` computes dc = dy W_down and da, db, c from it and the tiles of a and b. Each
(tokens x intermediate) tensor is then written once and read once less than through cuBLAS's products and the
activation pass, which are bound by the memory's bandwidth (benchmarks/mlp_epilogue_probe.py).
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401 (swiglu.py's launches build them)
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error


@triton.jit
def _silu(a):
    """silu(a) in float32 and the sigmoid it used."""
    sig = tl.sigmoid(a)
    return a * sig, sig


# N is specialized (Triton compiles one kernel for counts divisible by 16, one for the others): the masks of a
# count divisible by 16 allow vector loads, which measured 1.5-2x faster on the H200 than without.
@triton.jit
def _swiglu_fwd(A, B, C, N, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < N
    a = tl.load(A + offsets, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(B + offsets, mask=ok, other=0.0).to(tl.float32)
    s = _silu(a)[0].to(C.dtype.element_ty).to(tl.float32)
    tl.store(C + offsets, (s * b).to(C.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd(A, B, DC, DA, DB, C, N, BLOCK: tl.constexpr, RECOMPUTE: tl.constexpr):
    # DA may be DC (da in place: each element is read before it is written); A and B, kept by autograd, are only
    # read. Where RECOMPUTE, also c = s b into C (the forward's product, for down_proj's weight gradient) from the
    # same loads of a and b.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < N
    a = tl.load(A + offsets, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(B + offsets, mask=ok, other=0.0).to(tl.float32)
    dc = tl.load(DC + offsets, mask=ok, other=0.0).to(tl.float32)
    silu, sig = _silu(a)
    s = silu.to(A.dtype.element_ty).to(tl.float32)
    ds = (dc * b).to(DC.dtype.element_ty).to(tl.float32)
    tl.store(DA + offsets, (ds * sig * (1.0 + a * (1.0 - sig))).to(DA.dtype.element_ty), mask=ok)
    tl.store(DB + offsets, (dc * s).to(DB.dtype.element_ty), mask=ok)
    if RECOMPUTE:
        tl.store(C + offsets, (s * b).to(C.dtype.element_ty), mask=ok)


@triton.jit
def _output_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """The (row, column) of output tile `tile`, in groups of GROUP_M rows of tiles (their operands stay in L2)."""
    in_group = GROUP_M * tiles_n
    first_m = (tile // in_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    return first_m + (tile % group_m), (tile % in_group) // group_m


# TOKENS_BUCKET (`_triton.length_bucket` of M) and PER_SM (programs a multiprocessor, which the launch's grid reads)
# are for the autotuners; the kernels do not read them.
@triton.jit(do_not_specialize=["TOKENS_BUCKET"])
def _gate_up_swiglu(Xd, WGd, WUd, Ad, Bd, Cd, M, N, K, TOKENS_BUCKET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PER_SM: tl.constexpr, GROUP_M: tl.constexpr = 8):
    """a = X W_gate^T, b = X W_up^T and c = s b: X (M x K), W_gate and W_up (N x K), a, b and c (M x N), as TMA
    descriptors. The programs loop over the output tiles (persistent); `flatten` lets a tile's loads start during
    the previous tile's epilogue."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _output_tile(tile, tiles_m, tiles_n, GROUP_M)
        m, n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = Xd.load([m, k])
            acc_a = tl.dot(x, WGd.load([n, k]).T, acc_a)
            acc_b = tl.dot(x, WUd.load([n, k]).T, acc_b)
        a, b = acc_a.to(Ad.dtype), acc_b.to(Bd.dtype)  # rounded as the products' outputs are
        Ad.store([m, n], a)
        Bd.store([m, n], b)
        s = _silu(a.to(tl.float32))[0].to(Cd.dtype).to(tl.float32)
        Cd.store([m, n], (s * b.to(tl.float32)).to(Cd.dtype))


@triton.jit
def _swiglu_bwd_tile(dc, m, n, Ad, Bd, DAd, DBd, Cd, RECOMPUTE: tl.constexpr):
    """`_swiglu_bwd`'s arithmetic on one tile of dc (float32, the product's accumulator) at (m, n)."""
    dc = dc.to(DAd.dtype).to(tl.float32)  # rounded as the product's output is
    a = Ad.load([m, n]).to(tl.float32)
    b = Bd.load([m, n]).to(tl.float32)
    silu, sig = _silu(a)
    s = silu.to(DAd.dtype).to(tl.float32)
    ds = (dc * b).to(DAd.dtype).to(tl.float32)
    DAd.store([m, n], (ds * sig * (1.0 + a * (1.0 - sig))).to(DAd.dtype))
    DBd.store([m, n], (dc * s).to(DBd.dtype))
    if RECOMPUTE:
        Cd.store([m, n], (s * b).to(Cd.dtype))


@triton.jit
def _halves(x, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
    """The left and right halves of a (ROWS x COLUMNS) block."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLUMNS // 2)), (0, 2, 1)))


@triton.jit(do_not_specialize=["TOKENS_BUCKET"])
def _down_grad_swiglu(DYd, WDd, Ad, Bd, DAd, DBd, Cd, M, N, K, TOKENS_BUCKET, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_SM: tl.constexpr, CHUNKS: tl.constexpr,
                      RECOMPUTE: tl.constexpr, GROUP_M: tl.constexpr = 8):
    """dc = DY W_down (DY: M x K, W_down: K x N) and, from it, da, db and (where RECOMPUTE) c, all M x N, as TMA
    descriptors; persistent as `_gate_up_swiglu`. The epilogue runs in CHUNKS (1, 2 or 4) blocks of BLOCK_N / CHUNKS
    columns (the blocks of the descriptors of a, b, da, db and c): its float32 terms of a whole tile would not fit
    the registers beside the accumulator (compiled for sm_90a, 128 x 128 tiles whole spilled 236 bytes a thread)."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _output_tile(tile, tiles_m, tiles_n, GROUP_M)
        m, n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(DYd.load([m, k]), WDd.load([k, n]), acc)
        if CHUNKS == 1:
            _swiglu_bwd_tile(acc, m, n, Ad, Bd, DAd, DBd, Cd, RECOMPUTE)
        else:
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            if CHUNKS == 2:
                _swiglu_bwd_tile(left, m, n, Ad, Bd, DAd, DBd, Cd, RECOMPUTE)
                _swiglu_bwd_tile(right, m, n + BLOCK_N // 2, Ad, Bd, DAd, DBd, Cd, RECOMPUTE)
            else:
                quarter = BLOCK_N // 4
                first, second = _halves(left, BLOCK_M, BLOCK_N // 2)
                _swiglu_bwd_tile(first, m, n, Ad, Bd, DAd, DBd, Cd, RECOMPUTE)
                _swiglu_bwd_tile(second, m, n + quarter, Ad, Bd, DAd, DBd, Cd, RECOMPUTE)
                third, fourth = _halves(right, BLOCK_M, BLOCK_N // 2)
                _swiglu_bwd_tile(third, m, n + 2 * quarter, Ad, Bd, DAd, DBd, Cd, RECOMPUTE)
                _swiglu_bwd_tile(fourth, m, n + 3 * quarter, Ad, Bd, DAd, DBd, Cd, RECOMPUTE)
