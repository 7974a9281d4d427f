"""RMSNorm of the decoder (transformers' LlamaRMSNorm) in one Triton pass forward and one backward.

LlamaRMSNorm (Zhang & Sennrich, arXiv 1910.07467) runs as about six elementwise kernels on float32 copies of
the hidden states, and autograd keeps two of those copies for the backward. The kernel (`triton_rmsnorm.py`)
reads and writes the hidden states once, keeps only the input and one float32 per row for the backward, and
rounds where LlamaRMSNorm does (the normalized states to the input dtype before the weight). The decoder's norms
take it on the project's fast paths (`modeling_diff_llama.DiffLlamaRMSNorm`). `add_rms_norm` also takes the
decoder's residual add before a norm into the same pass, and in training its backward adds the residual stream's
gradient in the norm's backward pass: the add's kernel forward and the gradients' sum backward are not launched.
"""

import torch

from ._triton import (
    TRITON_AVAILABLE, cdiv, dependent_launch, eager_kernels_run_on, needs_grad, next_power_of_2, promoted_dtype,
)

if TRITON_AVAILABLE:
    from .triton_rmsnorm import _rms_norm_bwd, _rms_norm_dw_sum, _rms_norm_fwd

BACKWARD_ROWS = 16  # rows per program of the backward (each program writes one partial dw)
DW_SUM_BLOCK_N = 8  # columns per program of the partial dw's sum (2048 wide: 256 programs)
DW_SUM_BLOCK_P = 128  # partial dw rows a program sums per load (benchmarks/rmsnorm_backward_bench.py)


def rms_norm_kernel_applies(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        eager_kernels_run_on(hidden_states)
        and type(hidden_states) is torch.Tensor
        and type(weight) is torch.nn.Parameter  # not a DTensor (tensor parallel) or a wrapped weight
        and weight.dim() == 1 and hidden_states.shape[-1] == weight.shape[0]
    )


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, save: bool, residual: torch.Tensor | None = None):
    """x (..., N) contiguous -> (residual + x where `residual` is given (the norm is then of that sum) else None,
    y of x's shape, rstd (rows,) float32 only where `save`: for the backward). The rows are x's leading dims
    flattened, N apart; no reshape or view: decoding steps are bound by host work."""
    width = x.shape[-1]
    rows = x.numel() // width
    total = None if residual is None else torch.empty_like(residual)
    y = torch.empty(x.shape, dtype=promoted_dtype(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device) if save else None
    pdl = not save and dependent_launch(x, rows)  # decoding steps
    _rms_norm_fwd[(rows,)](x, weight, y, y if rstd is None else rstd, x if residual is None else residual,
                           x if total is None else total, rows, width, eps, BLOCK_N=next_power_of_2(width),
                           SAVE=save, ADD=residual is not None, PDL=pdl, launch_pdl=pdl)
    return total, y, rstd


def _backward_pass(x, weight, rstd, grad_y, grad_sum):
    """The backward's pass over the rows -> (x's gradient, plus `grad_sum` where given (x's gradient from its other
    uses), in x's dtype; the weight's gradient as float32 partial sums, (programs, width): one per BACKWARD_ROWS)."""
    width = x.shape[-1]
    rows = x.numel() // width
    programs = cdiv(rows, BACKWARD_ROWS)
    grad_x = torch.empty_like(x)
    grad_parts = torch.empty(programs, width, dtype=torch.float32, device=x.device)
    grad_sum = None if grad_sum is None else grad_sum.contiguous()
    _rms_norm_bwd[(programs,)](
        x, weight, rstd, grad_y.contiguous(), grad_x if grad_sum is None else grad_sum, grad_x, grad_parts, rows,
        width, BLOCK_N=next_power_of_2(width), ROWS=BACKWARD_ROWS, ADD=grad_sum is not None,
    )
    return grad_x, grad_parts


def _backward(x, weight, rstd, grad_y, grad_sum, need_weight: bool):
    """-> (x's gradient as `_backward_pass` gives it; the weight's where `need_weight`, its partial sums summed in
    one launch that writes the weight's dtype)."""
    grad_x, grad_parts = _backward_pass(x, weight, rstd, grad_y, grad_sum)
    if not need_weight:
        return grad_x, None
    programs, width = grad_parts.shape
    grad_weight = torch.empty(width, dtype=weight.dtype, device=weight.device)  # contiguous, as the kernel writes it
    _rms_norm_dw_sum[(cdiv(width, DW_SUM_BLOCK_N),)](grad_parts, grad_weight, programs, width,
                                                      BLOCK_P=DW_SUM_BLOCK_P, BLOCK_N=DW_SUM_BLOCK_N)
    return grad_x, grad_weight


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        _, y, rstd = _forward(x, weight, eps, save=True)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        return *_backward(x, weight, rstd, grad_y, None, ctx.needs_input_grad[1]), None


class _AddRMSNorm(torch.autograd.Function):
    """(residual + update, the norm of it) as one node: the backward's gradient of both inputs is the sum's own
    gradient (from the residual stream: None where the sum is not used further) plus the norm's, in one pass."""

    @staticmethod
    def forward(ctx, residual, update, weight, eps):
        total, y, rstd = _forward(update, weight, eps, save=True, residual=residual)
        ctx.save_for_backward(total, weight, rstd)
        ctx.set_materialize_grads(False)
        return total, y

    @staticmethod
    def backward(ctx, grad_total, grad_y):
        total, weight, rstd = ctx.saved_tensors
        if grad_y is None:  # the norm's output unused: the add's backward alone
            return grad_total, grad_total, None, None
        grad, grad_weight = _backward(total, weight, rstd, grad_y, grad_total, ctx.needs_input_grad[2])
        return grad, grad, grad_weight, None


def add_rms_norm_applies(residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes the sum and its norm in one pass: two contiguous plain tensors of one shape and
    dtype, and the norm's kernel applies."""
    return (
        type(update) is torch.Tensor
        and residual.shape == update.shape and residual.dtype == update.dtype
        and residual.is_contiguous() and update.is_contiguous()
        and rms_norm_kernel_applies(residual, weight)
    )


def add_rms_norm(residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float):
    """(residual + update, LlamaRMSNorm of it) in one pass (check `add_rms_norm_applies` first): the decoder layer's
    residual add and the norm after it, the sum rounded to the dtype as `residual + update` rounds it. Where
    gradients are recorded, one node whose backward is one pass too (`_AddRMSNorm`)."""
    if needs_grad(residual, update, weight):
        return _AddRMSNorm.apply(residual, update, weight, eps)
    return _forward(update, weight, eps, save=False, residual=residual)[:2]


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward through the kernel (check `rms_norm_kernel_applies` first); any leading dims."""
    x = hidden_states.contiguous()
    if needs_grad(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return _forward(x, weight, eps, save=False)[1]  # decoding: no autograd node to build
