"""The Linear maps of a decoding step in fewer, fuller launches: q, k, v (and V2's lambda_proj) in one, and the MLP's
gate and up with silu(gate) * up in one (`triton_projection.py`).

A decoding step reads every weight once for a handful of tokens, so its speed is the bytes a launch keeps in
flight. cuBLAS's kernels for one token measured 0.4 TB/s on the ~1.1B model's k and v (2 MB each) and 1.5 TB/s
on q and o (8 MB), against a 4.2 TB/s copy (benchmarks/RESULTS.md); one launch over q, k and v reads 12 MB with
every program of the GPU busy, and the gated one reads gate and up side by side and writes only silu(gate) * up,
not gate, up and the product. The reference is the layers' own forward (F.linear and LlamaMLP's activation).

    linear_maps(x (..., K), *linears) -> each linear(x), (..., N_i)
    gated_projection(x (..., K), gate, up) -> silu(gate(x)) * up(x), (..., I)

Both take the kernel only where it applies (`few_rows_apply`): no gradient, on CUDA (or the interpreter) outside
torch.compile, at most MAX_ROWS tokens, plain bias-free Linear layers of x's 16-bit dtype; elsewhere each layer runs
its own forward, so PEFT's LoRA layers, tensor-parallel or quantized layers and hooks keep their behaviour.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ._modules import is_plain_linear
from ._triton import TRITON_AVAILABLE, TRITON_INTERPRETING, cdiv, eager_kernels_run_on, next_power_of_2

if TRITON_AVAILABLE:
    from .triton_projection import _gated_projection, _projections

MAX_ROWS = 64  # tokens of a step the kernels take (x padded to a power of two >= 16 rows on the tensor cores)
MAX_WEIGHTS = 4  # weights of one `_projections` launch
BLOCK_K = 256  # of the reduction dimension per step of a program's loop
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def few_rows_apply(x: torch.Tensor, linears) -> bool:
    """Whether the kernels compute these layers of x (see the module docstring); the cheap checks first."""
    return (
        not torch.is_grad_enabled()
        and eager_kernels_run_on(x)
        and type(x) is torch.Tensor
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and (x.dtype in KERNEL_DTYPES or TRITON_INTERPRETING)
        and block_k(x.shape[-1]) >= 16
        and all(
            is_plain_linear(layer) and layer.bias is None and layer.weight.dtype == x.dtype
            and layer.weight.device == x.device and layer.weight.is_contiguous()
            for layer in linears
        )
    )


def block_k(width: int) -> int:
    """The reduction's step: the largest power of two <= BLOCK_K dividing the width (the loop has no mask)."""
    return min(BLOCK_K, width & -width)


def block_rows(n: int) -> int:
    """Weight rows per program: 16 (the tensor cores' least) for the small matrices of a step, so that even k and v
    give the GPU's multiprocessors a program each; 32 for the MLP's and the lm_head's."""
    return 16 if n <= 4096 else 32


def linear_maps(x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """(linear(x) for each of `linears`): the kernel's launches where they apply, each layer's forward otherwise."""
    if not few_rows_apply(x, linears):
        return tuple(layer(x) for layer in linears)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    m, k = rows.shape
    block_m = max(16, next_power_of_2(m))  # x's rows padded for the tensor cores
    outputs = []
    for start in range(0, len(linears), MAX_WEIGHTS):
        group = linears[start:start + MAX_WEIGHTS]
        weights = [layer.weight for layer in group]
        ys = [torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device) for w in weights]
        block_n = block_rows(max(w.shape[0] for w in weights))
        programs = sum(cdiv(w.shape[0], block_n) for w in weights)
        pad = MAX_WEIGHTS - len(group)
        _projections[(programs,)](
            rows, *weights, *weights[:1] * pad, *ys, *ys[:1] * pad, m,
            *(w.shape[0] for w in weights), *(0,) * pad, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k(k),
        )
        outputs += ys
    return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in outputs)


def gated_projection(x: torch.Tensor, gate: nn.Linear, up: nn.Linear) -> torch.Tensor:
    """silu(gate(x)) * up(x), LlamaMLP's activation with its rounding (gate(x), silu and the product each rounded to
    the dtype): one launch where the kernel applies, the layers' forward otherwise."""
    if not (few_rows_apply(x, (gate, up)) and gate.weight.shape == up.weight.shape):
        return F.silu(gate(x)) * up(x)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    m, k = rows.shape
    n = gate.weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, next_power_of_2(m))  # x's rows padded for the tensor cores
    block_n = block_rows(n)
    _gated_projection[(cdiv(n, block_n),)](
        rows, gate.weight, up.weight, y, m, n, K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k(k),
    )
    return y.view(*x.shape[:-1], n)
