"""Whether triton can be used here, decided once at import (plain constants: torch.compile traces them), whether
a call needs an autograd node (the kernels' forward-only launches serve the calls that do not), and the integer
arithmetic of launch grids.

Nothing here imports triton, but under its interpreter (`interpreter_takes_runtime_loop_bounds`): the model (and its
Hub export) loads where triton is absent, and the Triton paths are simply not chosen there.
"""

import functools
import importlib.metadata
import importlib.util
import os
import re
import weakref

import torch

# The kernels take host tensor descriptors (TMA), whose in-kernel `load` came with triton 3.4 (torch 2.8's).
MIN_TRITON = (3, 4)


def triton_is_recent(version: str) -> bool:
    """Whether a triton of `version` ("3.6.0", "3.4.0+git1a2b3c") has what the kernels use (MIN_TRITON)."""
    major_minor = re.match(r"(\d+)\.(\d+)", version)
    return major_minor is not None and tuple(map(int, major_minor.groups())) >= MIN_TRITON


def _recent_triton_installed() -> bool:
    """Whether a triton is installed and recent (`triton_is_recent`); a build under another name (pytorch-triton)
    counts as recent."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        return triton_is_recent(importlib.metadata.version("triton"))
    except importlib.metadata.PackageNotFoundError:
        return True


# An older triton leaves the model on its PyTorch paths, as no triton does.
TRITON_AVAILABLE = _recent_triton_installed()
# TRITON_INTERPRET=1 (set before triton is first imported) runs the kernels on CPU tensors through Triton's
# interpreter: how CI tests them.
TRITON_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_takes_runtime_loop_bounds() -> None:
    """Lets the interpreter run the kernels' loops over bounds known only at run time (a program's causal key range),
    as the GPU does. The interpreter holds a scalar as a NumPy array of one element and turns it into a loop bound
    with `int(array)`, which NumPy 2.4 refuses for arrays that are not 0-dimensional ("only 0-dimensional arrays can
    be converted to Python scalars"); this takes the element (`array.item()`), the value `int` gave before. Without
    it the kernels could be tested on the CPU only through loops of compile-time bounds, which no GPU runs. Idempotent;
    does nothing where the interpreter has no `_patch_lang_tensor` (triton 3.6's has)."""
    try:  # in a try block: transformers' remote-code loader requires every import outside one (of a Hub export's
        # files) to be installed
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "indexes_one_element", False):
        return

    def patch_tensor_indexing_one_element(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_tensor_indexing_one_element.indexes_one_element = True
    interpreter._patch_lang_tensor = patch_tensor_indexing_one_element


if TRITON_AVAILABLE and TRITON_INTERPRETING:
    interpreter_takes_runtime_loop_bounds()

# Programmatic dependent launch (PDL, compute capability 9.0+): a kernel launched with it may start while the
# kernel before it in the stream finishes, and waits (griddepcontrol.wait, `triton_launch.py`) before it reads
# anything the kernels before it wrote; before that wait it reads only weights. It is for steps of at most
# PDL_MAX_TOKENS tokens, DECODE_PDL_MAX_TOKENS for the decode kernel and its reduce: on the H200 it took a batch-1
# step of the ~1.1B models from 1.30 to 1.15 ms with o_proj and down_proj split; at batch 32 and a 2K context the
# norms and the projections under it took V1's step from 1.689 to 1.666 ms (V2 1.676 -> 1.673, DEX 1.652 -> 1.627),
# where the decode kernel under it had made V1's slower (1.756 -> 1.945 ms; benchmarks/decode_variants.py
# --pdl-more-tokens). MODELING_DIFF_PDL=0 turns it off.
PDL_ENABLED = os.environ.get("MODELING_DIFF_PDL", "1") != "0"
PDL_MAX_TOKENS = 32
DECODE_PDL_MAX_TOKENS = 16


def triton_available() -> bool:
    return TRITON_AVAILABLE


def eager_kernels_run_on(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels can be launched on `tensor` from eager code: triton is there, the tensor is on
    CUDA (or the interpreter runs them on CPU), and torch.compile is not tracing (Inductor fuses the references)."""
    return TRITON_AVAILABLE and (tensor.is_cuda or TRITON_INTERPRETING) and not torch.compiler.is_compiling()


@functools.cache
def _has_dependent_launch(index: int) -> bool:
    """An NVIDIA GPU of compute capability 9.0+ (ROCm's devices report capabilities of their own: no PDL there)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0)


def dependent_launch(tensor: torch.Tensor, tokens: int, most: int | None = None) -> bool:
    """Whether a kernel of a step of `tokens` tokens on `tensor` launches with PDL (see PDL_ENABLED): at most `most`
    (PDL_MAX_TOKENS where not given; both read at the call, so that benchmarks/decode_variants.py can set them), on
    NVIDIA GPUs of compute capability 9.0+ (the interpreter runs on CPU tensors: never)."""
    return (
        PDL_ENABLED and tokens <= (PDL_MAX_TOKENS if most is None else most) and tensor.is_cuda
        and _has_dependent_launch(tensor.get_device())
    )


# The ticket counters of the kernels whose last program finishes a launch's work (`cache_write.py`, `projection.py`):
# int32 zeros, one tensor per owner (a cache layer, a weight) and device, so that launches on different streams
# never share one; the last program of a launch puts its tickets back to 0. Never replaced while its owner lives
# (a captured CUDA graph keeps its address), so each is allocated at the largest count its owner can ask. Keyed by
# the owner's id and dropped with it (a tensor cannot be a weak dictionary's key: its == is elementwise).
_TICKETS: dict[int, dict[torch.device, torch.Tensor]] = {}


def tickets_of(owner, count: int, device: torch.device) -> torch.Tensor:
    """The zeroed int32 tickets (at least `count`) of `owner`'s launches on `device`. Allocated on first use; under
    a CUDA graph capture the zeros would be captured, not run, so the first use must be outside one (warm-up)."""
    per_device = _TICKETS.get(id(owner))
    if per_device is None:
        per_device = _TICKETS[id(owner)] = {}
        weakref.finalize(owner, _TICKETS.pop, id(owner), None)
    counters = per_device.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("modeling_diff's decoding kernels ran first inside a CUDA graph capture: run the step "
                               "once outside it first (warm-up), as torch.cuda.graph's documentation asks")
        counters = per_device[device] = torch.zeros(count, dtype=torch.int32, device=device)
    if counters.numel() < count:
        raise ValueError(f"tickets: {count} asked of a counter of {counters.numel()} (one allocation per owner)")
    return counters


INTERPRETER_SM_COUNT = 4  # multiprocessors where the interpreter runs the kernels: grids of a few waves in CI
INTERPRETER_SHARED_MEMORY = 227 * 1024  # the H200's, where the interpreter runs the kernels (CI)
INTERPRETER_SM_SHARED_MEMORY = 228 * 1024  # the H200's for a multiprocessor's resident programs


@functools.cache
def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on `device`: the kernels' pipelines must fit (227 KiB on an H200,
    163 KiB on an A100, 99 KiB on most other GPUs)."""
    if device.type != "cuda":
        return INTERPRETER_SHARED_MEMORY
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 99 * 1024)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (132 on an H200): what a launch's programs fill in waves."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def needs_grad(*tensors) -> bool:
    """Whether autograd records a call on these tensors (None entries are skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def product_dtype(x: torch.Tensor, *weights: torch.Tensor) -> torch.dtype | None:
    """The dtype that F.linear's products of x with `weights` run in: x's where autocast is off and every weight has
    it; autocast's where it is on and x and every weight are float32 or of that dtype (Trainer's `bf16=True` runs
    the forward under bf16 autocast: it casts nothing of a bf16 model, and a float32 model's weights and
    activations to bf16); None otherwise. A node that runs its products itself casts its inputs to it first (as
    autocast would), and then computes what the modules' own forward would."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x.dtype if all(w.dtype == x.dtype for w in weights) else None
    dtype = torch.get_autocast_dtype(device_type)
    return dtype if all(t.dtype in (dtype, torch.float32) for t in (x, *weights)) else None


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for operands of `dtype`: float32 products in full precision ("ieee"), as torch's own
    float32 matmuls, unless torch allows them TF32 (`torch.backends.cuda.matmul.fp32_precision = "tf32"`, or
    `torch.set_float32_matmul_precision("high")`, which sets it). Triton's default is TF32 (10 bits of mantissa): while
    the decode kernel took it, a float32 model's generate logits lay 8e-4 off eager's on an H100, where its forward
    passes agreed to 1e-6.
    bf16 / fp16 operands take no such choice ("tf32": the default). (torch.get_float32_matmul_precision raises once
    the newer setting was used, so it is read only where torch has no newer setting.)"""
    if dtype != torch.float32:
        return "tf32"
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        tf32 = matmul.fp32_precision == "tf32"
    else:
        tf32 = torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "ieee"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    if type(n) is int:
        return 1 << (n - 1).bit_length()
    n -= 1  # a SymInt, where torch.compile traces a launch (decode_attention_op): the same, in its arithmetic
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


def is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.cache
def promoted_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """torch.promote_types, memoized: it is a dispatcher call, and decoding steps ask it for every launch."""
    return torch.promote_types(a, b)
