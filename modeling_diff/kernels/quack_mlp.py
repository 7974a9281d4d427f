"""The SwiGLU MLP's training products on quack's GEMMs (Tri Dao's `quack-kernels`, Apache-2.0, written in NVIDIA's
CuTe DSL; installed with `flash-attn-4`, or alone with `pip install "modeling_diff[quack]"`), with the activation in
their epilogues: on a Hopper GPU where the package is installed and `MODELING_DIFF_QUACK=1` is set (opt-in: on an
H100 no faster than `swiglu.py`'s node, benchmarks/results_h100_quack_mlp.md).

`swiglu.py`'s node runs gate and up as cuBLAS products and the activation as passes of their own over the
(tokens x intermediate) tensors: forward, read gate(x) and up(x), write c = silu(gate(x)) * up(x); backward, read
gate(x), up(x) and dc, write da, db and c again. At 2K x 4 on the ~1.1B model those passes are 5-6 ms of a 100-125
ms training step, about the bandwidth's time for them (benchmarks/RESULTS.md). Here the passes are in the products:

    forward:  preact, c = x @ [W_gate; W_up]^T with c = silu(gate) * up in the epilogue     (gemm_gated)
              out = c @ W_down^T                                                              (cuBLAS)
    backward: d_preact, c = dout @ W_down with (da, db) = dswiglu(gate, up, dc) in the epilogue (gemm_dgated)
              dW_down = dout^T @ c (cuBLAS); dx = d_preact @ [W_gate; W_up]; d[W_gate; W_up] = d_preact^T @ x

quack pairs gate and up column by column: `preact` (T, 2I) holds gate(x) and up(x) interleaved ([g0, u0, g1, u1,
...]), d_preact too, and with `concat_layout` its kernels read a [W_gate; W_up] weight (2I, hidden) as if it were
interleaved and write its gradient in that concatenated layout. The model keeps gate_proj and up_proj apart (a Llama
checkpoint's names and layout), so the node concatenates their weights (64 MiB a layer at the ~1.1B shapes: about
0.04 ms at an H100's bandwidth, estimated) in the forward and again in the backward rather than keep the copy
between them, and hands each projection its half of the weight gradient (views of one buffer). It keeps x and
preact: the two (tokens x intermediate) tensors `swiglu.py` keeps. The epilogue computes c from the float32
accumulators, where LlamaMLP rounds gate(x) and up(x) to the model's dtype first: equal to LlamaMLP to bf16's
rounding, not to the bit.

Everything else (no package, another GPU, float32, torch.compile's tracing, `MODELING_DIFF_QUACK` not 1) stays on
`swiglu.py`'s node.
"""

import functools
import importlib.metadata
import os
import re

import torch
import torch.nn.functional as F

from ._triton import TRITON_INTERPRETING

# Opt-in (`MODELING_DIFF_QUACK=1`): measured on an H100 no faster than `swiglu.py`'s node (quack's products about
# 12% slower than cuBLAS's; benchmarks/results_h100_quack_mlp.md).
ENABLED = os.environ.get("MODELING_DIFF_QUACK", "0") == "1"
DISTRIBUTION = "quack-kernels"
MIN_VERSION = (0, 6, 5)  # the version the calls below were written and checked against; flash-attn-4 asks >= 0.5.3
ACTIVATION = "swiglu"  # quack's name for silu(gate) * up
# quack's default configurations; True: its autotuner, which compiles several a shape at the first call
# (`benchmarks/quack_mlp_bench.py --tuned` measures both)
TUNED = False
# quack's kernels take operands whose contiguous dimension is a multiple of 16 bytes (its MLP module's rule: 8
# elements of 2 bytes; the gated projection's 2I a multiple of 16).
_ALIGNMENT = 8


@functools.cache
def quack_installed() -> bool:
    """Whether `quack-kernels` of at least MIN_VERSION is installed (read from its metadata: importing it loads
    CUTLASS's DSL, seconds)."""
    try:
        installed = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(part) for part in re.findall(r"\d+", installed)[:3]) >= MIN_VERSION


@functools.cache
def _is_hopper(device_index: int) -> bool:
    """An NVIDIA GPU of compute capability 9.x, the architecture these calls are compiled and checked for (quack has
    Blackwell kernels too)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] == 9


def quack_mlp_runs_on(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether the MLP's node can run on quack's GEMMs: turned on, the package installed, x and the weights
    bf16 or fp16 on a Hopper GPU, sizes that its kernels take, and neither Triton's interpreter (CI's CPU runs) nor
    torch.compile's tracing (Inductor fuses `swiglu.py`'s reference)."""
    hidden, intermediate = w_gate.shape[1], w_gate.shape[0]
    return (
        ENABLED
        and not TRITON_INTERPRETING
        and x.is_cuda
        and not torch.compiler.is_compiling()
        and x.dtype in (torch.bfloat16, torch.float16)
        and all(w.dtype == x.dtype for w in (w_gate, w_up, w_down))
        and hidden % _ALIGNMENT == 0 and intermediate % _ALIGNMENT == 0
        and quack_installed()
        and _is_hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())
    )


@functools.cache
def quack_gemms():
    """quack's (gemm, gemm_gated, gemm_dgated), imported at the first call that runs on them."""
    try:  # in a try block: transformers' remote-code loader requires every import outside one (of a Hub export's
        # files) to be installed; quack_mlp_runs_on found the distribution, so this import succeeds
        from quack.gemm_interface import gemm, gemm_dgated, gemm_gated
    except ImportError as error:
        raise ImportError(f"quack-kernels is installed but does not import ({error}); without `MODELING_DIFF_QUACK=1` "
                          "the MLP stays on cuBLAS and the project's activation kernel") from error
    return gemm, gemm_gated, gemm_dgated


class _QuackSwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        gemm, gemm_gated, _ = quack_gemms()
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # (T, hidden), each row contiguous as quack reads it
        w_in = torch.cat((w_gate, w_up))  # (2I, hidden): [W_gate; W_up]
        preact, product = gemm_gated(rows, w_in.T, activation=ACTIVATION, concat_layout=("B",), tuned=TUNED)
        # preact (T, 2I): gate(x) and up(x) interleaved; product (T, I): silu(gate(x)) * up(x)
        out = F.linear(product, w_down)  # (T, hidden); the product is freed here
        ctx.save_for_backward(rows, w_gate, w_up, w_down, preact)
        return out.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        gemm, _, gemm_dgated = quack_gemms()
        rows, w_gate, w_up, w_down, preact = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()  # (T, hidden)
        # (T, 2I) interleaved (da, db), and c again, from dc = grad_rows @ W_down in the epilogue
        grad_preact, product = gemm_dgated(grad_rows, w_down, preact, activation=ACTIVATION, dynamic_scheduler=True,
                                           tuned=TUNED)
        grad_w_down = grad_rows.t().mm(product) if need_down else None
        del product
        grad_x = grad_w_gate = grad_w_up = None
        if need_x:
            w_in = torch.cat((w_gate, w_up))  # (2I, hidden), as in the forward
            grad_x = gemm(grad_preact, w_in, concat_layout=("B",), dynamic_scheduler=True, tuned=TUNED)
            grad_x = grad_x.view(grad_out.shape[:-1] + (rows.shape[-1],))
        if need_gate or need_up:  # (2I, hidden) as [dW_gate; dW_up]
            grad_w_in = gemm(grad_preact.T, rows, concat_layout=("out",), dynamic_scheduler=True, tuned=TUNED)
            grad_w_gate, grad_w_up = grad_w_in.chunk(2)
            grad_w_gate, grad_w_up = (grad_w_gate if need_gate else None), (grad_w_up if need_up else None)
        return grad_x, grad_w_gate, grad_w_up, grad_w_down


def quack_swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with gradients, on quack's GEMMs (check `quack_mlp_runs_on` first); see the module
    docstring. x (..., hidden), w_gate and w_up (I, hidden), w_down (hidden, I) -> (..., hidden)."""
    return _QuackSwiGLUMLP.apply(x, w_gate, w_up, w_down)
