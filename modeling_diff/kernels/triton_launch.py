"""Programmatic dependent launch (PDL) inside the kernels of a decoding step (see `_triton.PDL_ENABLED`).

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is still running:
`let_dependents_start` at a kernel's start lets the next one launch, and `wait_for_inputs` blocks until every kernel
before it has finished and its writes are visible. What a kernel reads before that wait must not be written by
any kernel of the step: the weights. Both are no-ops where PDL is False (the interpreter, older GPUs).

Imported only when triton is installed.
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error


@triton.jit
def let_dependents_start(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
