"""What the fast paths share about the Linear layers whose weights they read directly."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from ._triton import needs_grad, product_dtype


# torch's global module hooks (`register_module_forward_hook` and its sisters), the dicts `nn.Module.__call__` reads,
# which torch changes in place: FlopCounterMode's module tracker and activation-steering tools register them.
GLOBAL_MODULE_HOOKS = (torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks,
                       torch_module._global_backward_hooks, torch_module._global_backward_pre_hooks)


def global_module_hooks() -> bool:
    """Whether any of torch's global module hooks is registered: they are called for every module call, so a path
    that skipped a module's call would hide it from them."""
    return any(GLOBAL_MODULE_HOOKS)


def runs_own_forward(module: nn.Module) -> bool:
    """No hooks (the module's own forward and backward hooks, torch's global ones) and no forward bound on the
    instance (accelerate's offloading, Liger's instance patch): a fast path may take the module's work without
    anyone missing a call. The hooks are those `nn.Module.__call__` checks before it skips its hook machinery. Of
    PEFT's `modules_to_save` wrapper, whose attributes read through to the active adapter's copy, the module it
    wraps and every copy too: a kernel reading the wrapper's parameters calls none of them. The dicts read
    directly: decoding steps ask this of several modules a layer, bound by host work."""
    if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
            or "forward" in module.__dict__ or global_module_hooks()):
        return False
    copies = module._modules.get("modules_to_save")
    if copies is None:
        return True
    wrapped = (module._modules.get("original_module"), *copies.values())
    return all(runs_own_forward(copy) for copy in wrapped if copy is not None)


def keep_own_forward(module: nn.Module) -> bool:
    """The `kernel_condition` of the project's RMSNorm classes (DiffLlamaRMSNorm, V1's subln): False, so that the
    `kernels` library's `kernelize`, which transformers >= 5.25 runs in every `from_pretrained`, binds no Hub layer's
    forward on them. They subclass LlamaRMSNorm and so carry its `use_kernel_forward_from_hub("RMSNorm")`, which maps
    to Liger's RMSNorm on CUDA. A bound forward would take DiffLlamaRMSNorm off the project's kernel (2.5x faster
    forward + backward than Liger's on the H200, benchmarks/RESULTS.md) and its residual add out of the norm's pass,
    and V1 off the flash-diff kernel, which reads subln's weight only where subln runs its own forward."""
    return False


def is_plain_norm(norm: nn.Module) -> bool:
    """A norm whose weight a kernel may read in place of calling it (V1's subln in the combine, the flash-diff and
    decode kernels): its own Parameter (not PEFT's wrapper or tensor parallelism's DTensor) and no hooks or forward
    bound on the instance (`runs_own_forward`): a hook on it sees every call eager makes."""
    return type(norm.weight) is nn.Parameter and runs_own_forward(norm)


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


def linear_in_product_dtype(x: torch.Tensor, linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A plain Linear's (weight, bias) cast to the dtype F.linear(x, weight, bias) runs its product in
    (`product_dtype`: autocast's where autocast casts), for a node that runs the product itself; the casts are
    autograd's, so the parameters' gradients come back in their own dtype, as through F.linear under autocast. None
    where the layer is not plain (`is_plain_linear`) or the dtypes are ones F.linear would refuse."""
    if not is_plain_linear(linear):
        return None
    dtype = product_dtype(x, *linear_parameters([linear]))
    if dtype is None:
        return None
    return linear.weight.to(dtype), None if linear.bias is None else linear.bias.to(dtype)


def shared_input_linears_apply(x: torch.Tensor, linears) -> bool:
    """Whether `shared_input_linears` takes the layers: two or more plain Linear layers (`is_plain_linear`),
    gradients recorded, and x and the parameters in one dtype, or autocast's (`product_dtype`)."""
    if len(linears) < 2 or not all(is_plain_linear(layer) for layer in linears):
        return False
    params = linear_parameters(linears)
    return product_dtype(x, *params) is not None and needs_grad(x, *params)


def linear_parameters(linears) -> list[torch.Tensor]:
    """The weights and biases (where there are) of Linear layers, in order."""
    return [p for layer in linears for p in (layer.weight, layer.bias) if p is not None]


def shared_input_linears(x: torch.Tensor, linears) -> tuple[torch.Tensor, ...]:
    """(layer(x) for each of `linears`), F.linear each, as one autograd node (check `shared_input_linears_apply`).
    Autograd would sum x's gradients from the layers with an add kernel each (two a layer for q, k and v, on a
    (tokens x hidden) tensor); this node's backward sums them in cuBLAS's epilogue (addmm into the sum so far),
    the widest layer's product last: reading the sum costs a product of more FLOPs least (on the H200 the
    accumulating form of k's and v's narrow products took 45 us a call against 16 for the plain one). Under autocast
    x and the parameters are cast first, as F.linear would cast them (`product_dtype`)."""
    dtype = product_dtype(x, *linear_parameters(linears))
    cast = [None if p is None else p.to(dtype) for layer in linears for p in (layer.weight, layer.bias)]
    return _SharedInputLinears.apply(x.to(dtype), *cast)


class _SharedInputLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *params):  # params: weight, bias (or None) of each layer
        weights, biases = params[0::2], params[1::2]
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)
        return tuple(F.linear(x, weight, bias) for weight, bias in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])  # (T, in)
        grad_rows = [None if grad is None else grad.reshape(-1, grad.shape[-1]) for grad in grads]  # (T, out_i)
        grad_x = None
        if ctx.needs_input_grad[0]:
            for i in sorted(range(len(weights)), key=lambda i: weights[i].shape[0]):  # the widest last
                grad, weight = grad_rows[i], weights[i]
                if grad is not None:  # None: an output not used
                    grad_x = grad.mm(weight) if grad_x is None else grad_x.addmm_(grad, weight)
        params_grads = []
        for i, grad in enumerate(grad_rows):
            params_grads.append(grad.t().mm(rows) if grad is not None and ctx.needs_input_grad[1 + 2 * i] else None)
            params_grads.append(grad.sum(0) if grad is not None and ctx.needs_input_grad[2 + 2 * i] else None)
        return None if grad_x is None else grad_x.view(x.shape), *params_grads
