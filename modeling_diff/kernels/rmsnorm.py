"""RMSNorm of the decoder (transformers' LlamaRMSNorm) in one Triton pass forward and one backward.

LlamaRMSNorm (Zhang & Sennrich, arXiv 1910.07467) runs as about six elementwise kernels on float32 copies of
the hidden states, and autograd keeps two of those copies for the backward. The kernel (`triton_rmsnorm.py`)
reads and writes the hidden states once, keeps only the input and one float32 per row for the backward, and
rounds where LlamaRMSNorm does (the normalized states to the input dtype before the weight). The decoder's norms
take it on the project's fast paths (`modeling_diff_llama.DiffLlamaRMSNorm`). Without gradients (decoding steps),
`add_rms_norm` also takes the residual add before the post-attention norm into the same pass: one launch a layer
fewer.
"""

import torch

from ._triton import (
    TRITON_AVAILABLE, cdiv, dependent_launch, eager_kernels_run_on, needs_grad, next_power_of_2, promoted_dtype,
)

if TRITON_AVAILABLE:
    from .triton_rmsnorm import _rms_norm_bwd, _rms_norm_fwd

BACKWARD_ROWS = 16  # rows per program of the backward (each program writes one partial dw)


def rms_norm_kernel_applies(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        eager_kernels_run_on(hidden_states)
        and type(hidden_states) is torch.Tensor
        and type(weight) is torch.nn.Parameter  # not a DTensor (tensor parallel) or a wrapped weight
        and weight.dim() == 1 and hidden_states.shape[-1] == weight.shape[0]
    )


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float, save: bool):
    """x (..., N) contiguous -> (y of x's shape, rstd (rows,) float32 only where `save`: for the backward).
    The rows are x's leading dims flattened, N apart; no reshape or view: decoding steps are bound by host work."""
    width = x.shape[-1]
    rows = x.numel() // width
    y = torch.empty(x.shape, dtype=promoted_dtype(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device) if save else None
    pdl = not save and dependent_launch(x, rows)  # decoding steps
    _rms_norm_fwd[(rows,)](x, weight, y, y if rstd is None else rstd, x, x, rows, width, eps,
                           BLOCK_N=next_power_of_2(width), SAVE=save, ADD=False, PDL=pdl, launch_pdl=pdl)
    return y, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps, save=True)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        width = x.shape[-1]
        rows = x.numel() // width
        programs = cdiv(rows, BACKWARD_ROWS)
        grad_x = torch.empty_like(x)
        grad_parts = torch.empty(programs, width, dtype=torch.float32, device=x.device)
        _rms_norm_bwd[(programs,)](
            x, weight, rstd, grad_y.contiguous(), grad_x, grad_parts, rows, width,
            BLOCK_N=next_power_of_2(width), ROWS=BACKWARD_ROWS,
        )
        return grad_x, grad_parts.sum(0).to(weight.dtype), None


def add_rms_norm_applies(residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes the sum and its norm in one pass: no gradients (decoding, inference), two
    contiguous plain tensors of one shape and dtype, and the norm's kernel applies."""
    return (
        not needs_grad(residual, update, weight)
        and type(update) is torch.Tensor
        and residual.shape == update.shape and residual.dtype == update.dtype
        and residual.is_contiguous() and update.is_contiguous()
        and rms_norm_kernel_applies(residual, weight)
    )


def add_rms_norm(residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float):
    """(residual + update, LlamaRMSNorm of it) in one pass (check `add_rms_norm_applies` first): the decoder layer's
    residual add and the norm after it, the sum rounded to the dtype as `residual + update` rounds it."""
    width = residual.shape[-1]
    rows = residual.numel() // width
    total = torch.empty_like(residual)
    y = torch.empty(residual.shape, dtype=promoted_dtype(weight.dtype, residual.dtype), device=residual.device)
    pdl = dependent_launch(residual, rows)
    _rms_norm_fwd[(rows,)](update, weight, y, y, residual, total, rows, width, eps,
                           BLOCK_N=next_power_of_2(width), SAVE=False, ADD=True, PDL=pdl, launch_pdl=pdl)
    return total, y


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's forward through the kernel (check `rms_norm_kernel_applies` first); any leading dims."""
    x = hidden_states.contiguous()
    if needs_grad(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return _forward(x, weight, eps, save=False)[0]  # decoding: no autograd node to build
