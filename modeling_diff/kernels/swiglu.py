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
from ._triton import (
    TRITON_AVAILABLE, TRITON_INTERPRETING, cdiv, eager_kernels_run_on, length_bucket, needs_grad, product_dtype,
    sm_count,
)

if TRITON_AVAILABLE:
    import triton

    from .triton_swiglu import TensorDescriptor, _down_grad_swiglu, _gate_up_swiglu, _swiglu_bwd, _swiglu_fwd

BLOCK = 1024  # elements per program of the activation pass

# The products with the activation in their epilogue (`triton_swiglu._gate_up_swiglu`, `_down_grad_swiglu`): tiles
# and programs a multiprocessor (PER_SM), autotuned per (intermediate, hidden, tokens' bucket) on a GPU; the
# interpreter runs small tiles over more than one tile a program.
if TRITON_INTERPRETING:
    _FORWARD_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, PER_SM=1)]
    _BACKWARD_CONFIGS = [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, PER_SM=1, CHUNKS=4)]
else:
    # (compiled for sm_90a, benchmarks/kernel_registers.py's way: none spills; those of PER_SM 2 fit twice in a
    # multiprocessor's registers and shared memory)
    _FORWARD_CONFIGS = [
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, PER_SM=1, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, PER_SM=1, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, PER_SM=2, num_warps=4, num_stages=3),
    ]
    _BACKWARD_CONFIGS = [
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, PER_SM=1, CHUNKS=4, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, PER_SM=1, CHUNKS=4, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, PER_SM=2, CHUNKS=4, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, PER_SM=2, CHUNKS=2, num_warps=4, num_stages=4),
    ]


def swiglu_mlp_applies(mlp: nn.Module, x: torch.Tensor) -> bool:
    """Whether an MLP with LlamaMLP's `gate_proj`, `up_proj`, `down_proj` and silu can run as `swiglu_mlp`: a call
    that records gradients, on the kernels' devices, x and the weights in one dtype or autocast's (`product_dtype`:
    the node casts them first, as F.linear would), and three plain bias-free Linear layers without hooks (not PEFT's
    LoRA layers, a tensor-parallel or offloading wrapper, or a quantized layer: they take the module path)."""
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return (
        torch.is_grad_enabled()  # first: decoding steps (no gradients) are bound by host work
        and eager_kernels_run_on(x)
        and mlp.config.hidden_act in ("silu", "swish")
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


def _tile_descriptors(args: dict) -> None:
    """The TMA descriptors among a launch's `args` get the config's tiles as their blocks: autotuning's pre-hook;
    under the interpreter, `_launch`'s."""
    rows, columns, inner = args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]
    epilogue = [rows, columns // args.get("CHUNKS", 1)]
    blocks = {"Xd": [rows, inner], "DYd": [rows, inner], "WGd": [columns, inner], "WUd": [columns, inner],
              "WDd": [inner, columns], **dict.fromkeys(("Ad", "Bd", "Cd", "DAd", "DBd"), epilogue)}
    for name, block in blocks.items():
        if name in args:
            args[name].block_shape = block


def _autotuned(kernel, configs):
    if TRITON_INTERPRETING:
        return kernel
    return triton.autotune(
        configs=[triton.Config({k: v for k, v in c.items() if not k.startswith("num_")}, num_warps=c["num_warps"],
                               num_stages=c["num_stages"], pre_hook=_tile_descriptors) for c in configs],
        key=["N", "K", "TOKENS_BUCKET"],
    )(kernel)


if TRITON_AVAILABLE:
    _GATE_UP_SWIGLU = _autotuned(_gate_up_swiglu, _FORWARD_CONFIGS)
    _DOWN_GRAD_SWIGLU = _autotuned(_down_grad_swiglu, _BACKWARD_CONFIGS)


def _launch(kernel, configs, tensors: dict, M: int, N: int, K: int, **constants) -> None:
    """One launch of a product kernel over `tensors` (name -> 2-D tensor, as TMA descriptors): M x N outputs, inner
    dimension K; persistent, PER_SM programs a multiprocessor (at most one a tile)."""
    args = {name: TensorDescriptor.from_tensor(t, [16, 16]) for name, t in tensors.items()}  # blocks: the config's
    device = next(iter(tensors.values())).device
    grid = lambda meta: (min(cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), sm_count(device) * meta["PER_SM"]),)  # noqa: E731
    if TRITON_INTERPRETING:  # no autotuner: its first config
        config = configs[0]
        _tile_descriptors({**args, **config})
        kernel[grid(config)](**args, M=M, N=N, K=K, TOKENS_BUCKET=0, **config, **constants)
    else:
        kernel[grid](**args, M=M, N=N, K=K, TOKENS_BUCKET=length_bucket(M), **constants)


def _products_take_the_activation(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the MLP's products run as the Triton kernels with the activation in their epilogue: a GPU with TMA
    (compute capability 9.0+) and 16-bit floats, or the interpreter (its tensor descriptors read no bfloat16:
    float16 and float32 there); rows and weights contiguous, their rows 16-byte aligned (TMA), some tokens."""
    if rows.is_cuda:
        if rows.dtype not in (torch.bfloat16, torch.float16) or torch.cuda.get_device_capability(rows.device) < (9, 0):
            return False
    elif rows.dtype not in (torch.float16, torch.float32):
        return False
    return rows.shape[0] > 0 and all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0
        for t in (rows, *weights)
    )


def _gate_up_activation(rows, w_gate, w_up):
    """(a, b, c): a = rows W_gate^T and b = rows W_up^T, as F.linear computes them, and c = silu(a) b."""
    if not _products_take_the_activation(rows, w_gate, w_up):
        gate, up = F.linear(rows, w_gate), F.linear(rows, w_up)
        return gate, up, _silu_mul(gate, up)
    (M, K), N = rows.shape, w_gate.shape[0]
    gate = rows.new_empty(M, N)
    up, product = torch.empty_like(gate), torch.empty_like(gate)
    _launch(_GATE_UP_SWIGLU, _FORWARD_CONFIGS, dict(Xd=rows, WGd=w_gate, WUd=w_up, Ad=gate, Bd=up, Cd=product),
            M, N, K)
    return gate, up, product


def _down_grad_activation(grad_rows, w_down, gate, up, recompute: bool):
    """(da, db, c where `recompute`, else None): dc = grad_rows W_down as the product computes it, and the activation's
    backward from it."""
    (M, K), N = grad_rows.shape, w_down.shape[1]
    if _products_take_the_activation(grad_rows, w_down, gate, up):
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        product = torch.empty_like(gate) if recompute else grad_up  # not written where not needed
        _launch(_DOWN_GRAD_SWIGLU, _BACKWARD_CONFIGS,
                dict(DYd=grad_rows, WDd=w_down, Ad=gate, Bd=up, DAd=grad_gate, DBd=grad_up, Cd=product), M, N, K,
                RECOMPUTE=recompute)
    else:
        grad_gate = grad_rows.mm(w_down)  # dc, then da in place
        grad_up = torch.empty_like(up)
        product = torch.empty_like(gate) if recompute else grad_up
        _swiglu_bwd[(cdiv(gate.numel(), BLOCK),)](
            gate, up, grad_gate, grad_gate, grad_up, product, gate.numel(), BLOCK=BLOCK, RECOMPUTE=recompute
        )
    return grad_gate, grad_up, product if recompute else None


class _SwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        rows = x.reshape(-1, x.shape[-1])  # (T, hidden)
        gate, up, product = _gate_up_activation(rows, w_gate, w_up)  # (T, I) each
        out = F.linear(product, w_down)  # (T, hidden)
        del product  # freed here
        ctx.save_for_backward(rows, w_gate, w_up, w_down, gate, up)
        return out.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        rows, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()  # (T, hidden)
        # c again for down_proj's weight gradient, from the same reads of gate(x) and up(x) as da and db
        grad_gate, grad_up, product = _down_grad_activation(grad_rows, w_down, gate, up, recompute=need_down)
        grad_w_down = grad_rows.t().mm(product) if need_down else None
        del product
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
    return _SwiGLUMLP.apply(x.to(dtype), w_gate.to(dtype), w_up.to(dtype), w_down.to(dtype))


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
