"""Triton SwiGLU activation, forward and a backward that recomputes the activation, with transformers' rounding.

Imported only when triton is installed (see `kernels/swiglu.py` for the reference, the dispatch and autograd).
a = gate(x), b = up(x), elementwise over (tokens x intermediate), s = silu(a) rounded to the dtype as
`ACT2FN["silu"]` returns it:

    forward   c = s b
    backward  db = dc s, ds = dc b (rounded), da = ds sig(a) (1 + a (1 - sig(a))); and c again where it is not kept
              (the MLP's node), from the same loads
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
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
