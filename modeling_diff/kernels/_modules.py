"""What the fast paths share about the Linear layers whose weights they read directly."""

from collections.abc import Callable

import torch
from torch import nn


def runs_own_forward(module: nn.Module) -> bool:
    """No hooks and no forward bound on the instance (accelerate's offloading, Liger's instance patch): a fast path
    may take the module's work without anyone missing a call. The dicts read directly: decoding steps ask this of
    several modules a layer, bound by host work."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def is_plain_linear(module: nn.Module) -> bool:
    """A torch Linear as built: its own Parameter and no hooks. Not PEFT's LoRA layers, a tensor-parallel,
    offloading (accelerate's `_hf_hook` forward) or quantized layer: those keep their own forward."""
    return (
        type(module) is nn.Linear
        and type(module._parameters.get("weight")) is nn.Parameter
        and runs_own_forward(module)
    )


def recomputed_linear_backward(grad_out: torch.Tensor, weight: torch.Tensor, recompute: Callable[[], torch.Tensor],
                               need_weight: bool, need_bias: bool):
    """The backward of F.linear(x, weight, bias) where x was not kept: grad_out (..., out) -> (grad of x (T, in),
    of weight, of bias; None where not needed). x = recompute(), (T, in), is made only for the weight's gradient
    and freed before the gradient of x is made, so the two (T, in) buffers never exist at once."""
    grad_rows = grad_out.reshape(-1, grad_out.shape[-1])  # (T, out)
    grad_weight = grad_rows.t().mm(recompute().view(grad_rows.shape[0], weight.shape[1])) if need_weight else None
    grad_bias = grad_rows.sum(0) if need_bias else None
    return grad_rows.mm(weight), grad_weight, grad_bias
