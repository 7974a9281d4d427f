"""The decoder's SwiGLU MLP in training, keeping two (tokens x intermediate) activations a layer, not three or four.

transformers' LlamaMLP computes down(silu(gate(x)) * up(x)), and autograd keeps four (tokens x intermediate)
tensors of it for the backward: gate(x), silu(gate(x)), up(x) and the product c (the input of down_proj); Liger's
SwiGLU MLP keeps three: gate(x), up(x) and c. c is elementwise in gate(x) and up(x), so `swiglu_mlp` keeps x,
gate(x) and up(x) and computes c again in the backward's activation pass (`triton_swiglu.py`), which reads them for
da and db anyway; down_proj's weight gradient follows that pass. In the ~1.1B benchmark (MLP 8192) that is 128 MiB
per layer per 8192 tokens less than Liger's: 2 GiB of a 2K x 4 step, 16 GiB of a 64K sequence
(benchmarks/RESULTS.md); the backward holds c, dc (then da) and db of one layer at once, one such buffer more than a
backward that recomputes c before dc exists. The arithmetic and its rounding are LlamaMLP's; the backward writes
only buffers of its own, so a graph kept with `retain_graph=True` can be run backward again.

    swiglu_mlp(x (..., hidden), w_gate (I, hidden), w_up (I, hidden), w_down (hidden, I)) -> (..., hidden)
"""

import torch
import torch.nn.functional as F
from torch import nn

from ._modules import is_plain_linear
from ._triton import TRITON_AVAILABLE, cdiv, eager_kernels_run_on, needs_grad, product_dtype

if TRITON_AVAILABLE:
    from .triton_swiglu import _swiglu_bwd, _swiglu_fwd

BLOCK = 1024  # elements per program


def swiglu_mlp_applies(mlp: nn.Module, x: torch.Tensor) -> bool:
    """Whether an MLP with LlamaMLP's `gate_proj`, `up_proj`, `down_proj` and silu can run as `swiglu_mlp`: a call
    that records gradients, on the kernels' devices, x and the weights in one dtype or autocast's (`product_dtype`:
    the node casts them first, as F.linear would), and three plain bias-free Linear layers and act_fn without hooks
    (not PEFT's LoRA layers, a tensor-parallel or offloading wrapper, or a quantized layer: they take the module
    path)."""
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return (
        torch.is_grad_enabled()  # first: decoding steps (no gradients) are bound by host work
        and eager_kernels_run_on(x)
        and mlp.activation_in_kernels()
        and all(is_plain_linear(p) and p.bias is None for p in projections)
        and product_dtype(x, *(p.weight for p in projections)) is not None
        and type(x) is torch.Tensor
        and needs_grad(x, *(p.weight for p in projections))
    )


def _silu_mul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(a) * b of two contiguous tensors (into `out` where given)."""
    out = torch.empty_like(a) if out is None else out
    _swiglu_fwd[(cdiv(a.numel(), BLOCK),)](a, b, out, a.numel(), BLOCK=BLOCK)
    return out


class _SwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        rows = x.reshape(-1, x.shape[-1])  # (T, hidden)
        gate, up = F.linear(rows, w_gate), F.linear(rows, w_up)  # (T, I) each
        out = F.linear(_silu_mul(gate, up), w_down)  # (T, hidden); the product is freed here
        ctx.save_for_backward(rows, w_gate, w_up, w_down, gate, up)
        return out.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        rows, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])  # (T, hidden)
        grad_product = grad_rows.mm(w_down)  # (T, I): dc, then da in place
        grad_up = torch.empty_like(up)
        # c again for down_proj's weight gradient, in the same pass as da and db: gate(x) and up(x) read once
        product = torch.empty_like(gate) if need_down else grad_up  # (T, I); not written where not needed
        _swiglu_bwd[(cdiv(gate.numel(), BLOCK),)](
            gate, up, grad_product, grad_product, grad_up, product, gate.numel(), BLOCK=BLOCK, RECOMPUTE=need_down
        )
        grad_w_down = grad_rows.t().mm(product) if need_down else None
        del product
        grad_gate = grad_product
        grad_x = None
        if need_x:
            grad_x = grad_gate.mm(w_gate).addmm_(grad_up, w_up).view(grad_out.shape)
        grad_w_gate = grad_gate.t().mm(rows) if need_gate else None
        grad_w_up = grad_up.t().mm(rows) if need_up else None
        return grad_x, grad_w_gate, grad_w_up, grad_w_down


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """LlamaMLP's forward in training (check `swiglu_mlp_applies` first); see the module docstring. Under autocast
    x and the weights are cast first, as F.linear would cast them (`product_dtype`)."""
    dtype = product_dtype(x, w_gate, w_up, w_down)
    x, w_gate, w_up, w_down = (t.to(dtype) for t in (x, w_gate, w_up, w_down))
    return _SwiGLUMLP.apply(x, w_gate, w_up, w_down)


class _SiLUMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return _silu_mul(a, b)

    @staticmethod
    def backward(ctx, grad_c):
        a, b = ctx.saved_tensors
        grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
        _swiglu_bwd[(cdiv(a.numel(), BLOCK),)](
            a, b, grad_c.contiguous(), grad_a, grad_b, grad_b, a.numel(), BLOCK=BLOCK, RECOMPUTE=False
        )
        return grad_a, grad_b


def silu_mul_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `silu_mul` takes silu(a) * b: a call that records gradients, on the kernels' devices, two plain
    tensors of one shape and dtype."""
    return (
        needs_grad(a, b)  # first: decoding steps (no gradients) are bound by host work
        and eager_kernels_run_on(a)
        and type(a) is torch.Tensor and type(b) is torch.Tensor
        and a.shape == b.shape and a.dtype == b.dtype
    )


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b in one pass, keeping a and b for the backward and not silu(a) (check `silu_mul_applies`
    first): the MLP's activation where its projections are not plain Linear layers (PEFT's LoRA layers, tensor
    parallelism, hooks), which keep their own inputs. One (tokens x intermediate) tensor fewer than LlamaMLP's
    act_fn(gate) * up keeps, as Liger's SwiGLU kernel does."""
    return _SiLUMul.apply(a, b)
