"""The differential combine after the attention call: PyTorch references and their fused Triton versions.

The attention call returns, for every differential head i, the pair of head outputs (2i, 2i+1) side by side
(`attn` of shape (B, L, 2h, D)). The combine turns each pair into one head:

- V1 (DIFF Transformer, arXiv 2410.05258, Eq. 3): `(1 - lambda_init) * subln(attn[2i] - lambda * attn[2i+1])`.
- V2 (unilm Diff-Transformer-V2): `attn[2i] - w[..., i] * attn[2i+1]`, w the per-token noise weight.

V1's lambda (`differential_lambda`) is a float32 scalar of four short vectors; its reference takes about a dozen
launches forward and as many backward, its kernel one each way.

DEX's operator (arXiv 2505.16333) is linear in a head's output, O_h - O_h G_h with G_h = lambda_h f_D(I), so in
training it is folded into o_proj's weight instead (`dex_folded_weight`, called by `DexAttention`); where f_D is a
plain weight, the fold with lambda(t) and its gradients are one launch forward and two backward
(`dex_folded_projection`), in place of about eight and fourteen small ones.

The references are the definition (and the path on CPU and under torch.compile, where Inductor fuses them);
on CUDA the Triton kernels do each combine in one pass forward and one pass backward. In training, V2's combine
and o_proj are one autograd node (`v2_combine_projected`), which keeps no combined output.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ._modules import is_plain_norm, linear_in_product_dtype, recomputed_linear_backward
from ._triton import (
    TRITON_AVAILABLE, cdiv, dot_precision, eager_kernels_run_on, is_power_of_2, needs_grad, next_power_of_2,
    triton_available,
)
from .decode import DexCombine

if TRITON_AVAILABLE:
    from .triton_combine import (
        _dex_fold_bwd, _dex_fold_bwd_reduce, _dex_fold_fwd, _differential_lambda_bwd, _differential_lambda_fwd,
        _v1_combine_bwd, _v1_combine_fwd, _v2_combine_bwd, _v2_combine_fwd,
    )


def differential_lambda_reference(vectors: tuple[torch.Tensor, ...], lambda_init: float) -> torch.Tensor:
    """V1's re-parameterised lambda (arXiv 2410.05258, Eq. 2), a float32 scalar, from (lambda_q1, lambda_k1,
    lambda_q2, lambda_k2): exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) + lambda_init."""
    q1, k1, q2, k2 = (v.float() for v in vectors)
    return torch.exp(torch.dot(q1, k1)) - torch.exp(torch.dot(q2, k2)) + lambda_init


class _DifferentialLambda(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, k1, q2, k2, lambda_init):
        lam = torch.empty((), dtype=torch.float32, device=q1.device)
        _differential_lambda_fwd[(1,)](q1, k1, q2, k2, lam, lambda_init, q1.numel())
        ctx.save_for_backward(q1, k1, q2, k2)
        return lam

    @staticmethod
    def backward(ctx, grad_lam):
        vectors = ctx.saved_tensors
        grads = [torch.empty_like(v) for v in vectors]
        _differential_lambda_bwd[(1,)](*vectors, grad_lam.float(), *grads, vectors[0].numel())
        return (*grads, None)


def differential_lambda_triton(vectors: tuple[torch.Tensor, ...], lambda_init: float) -> torch.Tensor:
    """The lambda kernel; same contract as `differential_lambda_reference` for vectors `_lambda_kernel_applies` to."""
    return _DifferentialLambda.apply(*vectors, float(lambda_init))


def _lambda_kernel_applies(vectors: tuple[torch.Tensor, ...]) -> bool:
    """CUDA tensors (on a CPU the reference's few operations cost less than an interpreted launch), plain ones (a
    DTensor or a tensor subclass takes the reference), of one dtype and device, contiguous, of one power-of-2 length,
    and no torch.compile tracing (Inductor fuses the reference)."""
    first = vectors[0]
    return (
        first.is_cuda
        and eager_kernels_run_on(first)
        and all(type(v) in (torch.Tensor, nn.Parameter) for v in vectors)
        and all(v.dim() == 1 and v.is_contiguous() and v.shape == first.shape for v in vectors)
        and all(v.dtype == first.dtype and v.device == first.device for v in vectors)
        and is_power_of_2(first.numel())
    )


def differential_lambda(vectors: tuple[torch.Tensor, ...], lambda_init: float) -> torch.Tensor:
    """`differential_lambda_reference`, in one launch forward and one backward where the kernels run."""
    if _lambda_kernel_applies(vectors):
        return differential_lambda_triton(vectors, lambda_init)
    return differential_lambda_reference(vectors, lambda_init)


def v1_combine_reference(attn: torch.Tensor, lam: torch.Tensor, subln: nn.Module, scale: float) -> torch.Tensor:
    """(B, L, 2h, 2d) -> (B, L, h, 2d)."""
    return subln(attn[:, :, 0::2] - lam.to(attn.dtype) * attn[:, :, 1::2]) * scale


def v2_combine_reference(attn: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(B, L, 2h, d), weight (B, L, h) -> (B, L, h, d)."""
    return attn[:, :, 0::2] - weight[..., None] * attn[:, :, 1::2]


def _rows_per_program(width: int) -> int:
    return max(1, 4096 // width)  # about 4K elements per tile


def v1_combine_backward(pairs, lam, weight, rstd, grad_out, scale: float, for_flash: bool = False):
    """Backward of the fused V1 combine. pairs (R, 2, D) = (A1 V, A2 V) per row, rstd (R,), grad_out (..., D).
    Returns (grad of the pairs (R, 2, D), grad of lam, grad of the norm weight, None); with `for_flash`, the first
    is the grad of A1 V alone (R, D) (that of A2 V is -lam times it) and the last the D terms (R, 2) of the flash
    backward, rowsum(dO_m * O_m) for the two maps m."""
    rows, _, width = pairs.shape
    block = _rows_per_program(width)
    programs = cdiv(rows, block)
    grad_pairs = torch.empty(rows, *(() if for_flash else (2,)), width, dtype=pairs.dtype, device=pairs.device)
    delta = torch.empty(rows, 2, dtype=torch.float32, device=pairs.device) if for_flash else None
    grad_weight = torch.empty(programs, width, dtype=torch.float32, device=pairs.device)
    grad_lam = torch.empty(programs, dtype=torch.float32, device=pairs.device)
    _v1_combine_bwd[(programs,)](
        pairs, lam, weight, rstd, grad_out.contiguous(), grad_pairs, grad_weight, grad_lam,
        delta if for_flash else grad_lam, rows, scale, width, block, for_flash,
    )
    return grad_pairs, grad_lam.sum().to(lam.dtype).reshape(lam.shape), grad_weight.sum(0).to(weight.dtype), delta


def v2_combine_backward(pairs, row_weight, grad_out, for_flash: bool = False):
    """Backward of the fused V2 combine. pairs (R, 2, D), row_weight (R,), grad_out (R, D). Returns (grad of the
    pairs (R, 2, D), grad of row_weight (R,), None); with `for_flash` the first is None (the grad of the signal
    head is grad_out itself) and the last the D terms (R, 2), as in `v1_combine_backward`."""
    rows, _, width = pairs.shape
    block = _rows_per_program(width)
    grad_pairs = None if for_flash else torch.empty_like(pairs)
    delta = torch.empty(rows, 2, dtype=torch.float32, device=pairs.device) if for_flash else None
    grad_weight = torch.empty_like(row_weight)
    _v2_combine_bwd[(cdiv(rows, block),)](
        pairs, row_weight, grad_out.contiguous(), pairs if for_flash else grad_pairs, grad_weight,
        delta if for_flash else grad_weight, rows, width, block, for_flash,
    )
    return grad_pairs, grad_weight, delta


def v1_combine_rows(pairs, lam, weight, eps, scale):
    """pairs (R, 2, D) -> (out (R, D), rstd (R,)): one launch of the fused V1 combine."""
    rows, _, width = pairs.shape
    out = torch.empty(rows, width, dtype=pairs.dtype, device=pairs.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=pairs.device)
    block = _rows_per_program(width)
    _v1_combine_fwd[(cdiv(rows, block),)](pairs, lam, weight, out, rstd, rows, eps, scale, width, block)
    return out, rstd


def _v1_combine_forward(attn, lam, weight, eps, scale):
    """-> (out (B, L, h, D), pairs (R, 2, D), rstd (R,)): the fused V1 combine of the attention's output."""
    batch, length, two_h, width = attn.shape
    pairs = attn.contiguous().view(-1, 2, width)  # (R, 2, D), R = B * L * h
    out, rstd = v1_combine_rows(pairs, lam, weight, eps, scale)
    return out.view(batch, length, two_h // 2, width), pairs, rstd


def v2_combine_rows(pairs, row_weight):
    """pairs (R, 2, D), row_weight (R,) -> (R, D): one launch of the fused V2 combine."""
    rows, _, width = pairs.shape
    out = torch.empty(rows, width, dtype=pairs.dtype, device=pairs.device)
    block = _rows_per_program(width)
    _v2_combine_fwd[(cdiv(rows, block),)](pairs, row_weight, out, rows, width, block)
    return out


def _v2_combine_forward(attn, weight):
    """-> (out (B, L, h, D), pairs (R, 2, D), row_weight (R,)): the fused V2 combine of the attention's output."""
    batch, length, two_h, width = attn.shape
    pairs = attn.contiguous().view(-1, 2, width)  # (R, 2, D), R = B * L * h
    row_weight = weight.contiguous().view(-1)  # (R,)
    return v2_combine_rows(pairs, row_weight).view(batch, length, two_h // 2, width), pairs, row_weight


class _V1Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, lam, weight, eps, scale):
        out, pairs, rstd = _v1_combine_forward(attn, lam, weight, eps, scale)
        ctx.save_for_backward(pairs, lam, weight, rstd)
        ctx.scale, ctx.shape = scale, attn.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        pairs, lam, weight, rstd = ctx.saved_tensors
        grad_pairs, grad_lam, grad_weight, _ = v1_combine_backward(pairs, lam, weight, rstd, grad_out, ctx.scale)
        return grad_pairs.view(ctx.shape), grad_lam, grad_weight, None, None


class _V2Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, weight):
        out, pairs, row_weight = _v2_combine_forward(attn, weight)
        ctx.save_for_backward(pairs, row_weight)
        ctx.shapes = attn.shape, weight.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        pairs, row_weight = ctx.saved_tensors
        grad_pairs, grad_weight, _ = v2_combine_backward(pairs, row_weight, grad_out)
        attn_shape, weight_shape = ctx.shapes
        return grad_pairs.view(attn_shape), grad_weight.view(weight_shape)


class _V2CombineProjection(torch.autograd.Function):
    """o_proj(V2 combine): keeps the pairs (the attention call's own output, which it keeps anyway) and not the
    combined heads (o_proj's input), which the backward computes again for o_proj's weight gradient. o_proj's
    product runs in its weight's dtype (the caller casts the weight to the dtype F.linear would use under autocast),
    the combined heads cast to it and their gradient cast back, as autocast's casts do."""

    @staticmethod
    def forward(ctx, attn, weight, o_weight, o_bias):
        out, pairs, row_weight = _v2_combine_forward(attn, weight)  # (B, L, h, d)
        ctx.save_for_backward(pairs, row_weight, o_weight)
        ctx.shapes = attn.shape, weight.shape
        return F.linear(out.flatten(-2).to(o_weight.dtype), o_weight, o_bias)  # (B, L, hidden)

    @staticmethod
    def backward(ctx, grad_out):
        pairs, row_weight, o_weight = ctx.saved_tensors
        attn_shape, weight_shape = ctx.shapes
        _, _, need_o_weight, need_o_bias = ctx.needs_input_grad
        grad_combined, grad_o_weight, grad_o_bias = recomputed_linear_backward(  # the combined heads again
            grad_out, o_weight, lambda: v2_combine_rows(pairs, row_weight).to(o_weight.dtype), need_o_weight,
            need_o_bias,
        )
        grad_combined = grad_combined.view(-1, pairs.shape[-1]).to(pairs.dtype)  # (R, d)
        grad_pairs, grad_weight, _ = v2_combine_backward(pairs, row_weight, grad_combined)
        return grad_pairs.view(attn_shape), grad_weight.view(weight_shape), grad_o_weight, grad_o_bias


def v2_combine_projection_triton(attn: torch.Tensor, weight: torch.Tensor, o_weight: torch.Tensor,
                                 o_bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(v2_combine(attn, weight), o_weight, o_bias), (B, L, 2h, d) -> (B, L, hidden), in one autograd node
    that keeps no combined output, the product in o_weight's dtype (`linear_in_product_dtype` gives o_proj's weight
    and bias in F.linear's; check `needs_grad` first: without gradients `v2_combine_triton` and o_proj are the
    same)."""
    return _V2CombineProjection.apply(attn, weight, o_weight, o_bias)


def v1_combine_triton(attn: torch.Tensor, lam: torch.Tensor, subln: nn.Module, scale: float) -> torch.Tensor:
    """The fused Triton V1 combine; same contract as `v1_combine_reference`."""
    args = (attn, lam.float(), subln.weight, subln.variance_epsilon, scale)
    if needs_grad(attn, lam, subln.weight):
        return _V1Combine.apply(*args)
    return _v1_combine_forward(*args)[0]  # decoding: no autograd node to build


def v2_combine_triton(attn: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fused Triton V2 combine; same contract as `v2_combine_reference`."""
    if needs_grad(attn, weight):
        return _V2Combine.apply(attn, weight)
    return _v2_combine_forward(attn, weight)[0]


def _fused(attn: torch.Tensor) -> bool:
    """Triton on CUDA in eager mode; under torch.compile Inductor fuses the reference itself."""
    return (
        attn.is_cuda
        and is_power_of_2(attn.shape[-1])
        and not torch.compiler.is_compiling()
        and triton_available()
    )


def v1_combine(attn: torch.Tensor, lam: torch.Tensor, subln: nn.Module, scale: float) -> torch.Tensor:
    """Triton reads subln's weight where subln is plain (`is_plain_norm`); a hooked or wrapped subln is called."""
    if _fused(attn) and is_plain_norm(subln):
        return v1_combine_triton(attn, lam, subln, scale)
    return v1_combine_reference(attn, lam, subln, scale)


def v2_combine(attn: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if _fused(attn):
        return v2_combine_triton(attn, weight)
    return v2_combine_reference(attn, weight)


def v2_combine_projected(attn: torch.Tensor, weight: torch.Tensor, o_proj: nn.Module) -> torch.Tensor:
    """o_proj(v2_combine(attn, weight)) (B, L, hidden). In training on the fused path with a plain o_proj, one node
    that keeps the attention's output but not the combined heads: (tokens x h x d) fewer kept per layer."""
    if _fused(attn) and needs_grad(attn, weight, o_proj.weight):
        o_params = linear_in_product_dtype(attn, o_proj)
        if o_params is not None:
            return v2_combine_projection_triton(attn, weight, *o_params)
    return o_proj(v2_combine(attn, weight).flatten(-2))


def _heads(matrix: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(rows, h * d) -> the (h, rows, d) view of each head's columns."""
    return matrix.view(matrix.shape[0], -1, head_dim).transpose(0, 1)


def _minus_heads_product(matrix: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """matrix (rows, h * d), right (h, d, d) -> M_h - M_h right_h for every head's columns M_h, in matrix's layout:
    one batched product that writes the (h, rows, d) view of its output (cuBLAS takes the head stride d and row
    stride h * d as they are), matrix copied in first, accumulated in float32 and rounded once."""
    out = torch.empty_like(matrix)
    heads = _heads(matrix, right.shape[-1])
    torch.baddbmm(heads, heads, right, alpha=-1, out=_heads(out, right.shape[-1]))
    return out


class _DexFoldedWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, operator):
        weight = weight.contiguous()  # the heads' view needs it (a copy only for a weight that is not)
        ctx.save_for_backward(weight, operator)
        return _minus_heads_product(weight, operator.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad):
        weight, operator = ctx.saved_tensors
        grad = grad.contiguous()
        # W'_h = W_h - W_h G_h^T: dW_h = dW'_h - dW'_h G_h and dG_h = -dW'_h^T W_h (d, d)
        grad_weight = _minus_heads_product(grad, operator) if ctx.needs_input_grad[0] else None
        grad_operator = None
        if ctx.needs_input_grad[1]:
            d = operator.shape[-1]
            grad_heads = _heads(grad, d).transpose(1, 2)  # (h, d, hidden)
            grad_operator = torch.baddbmm(operator, grad_heads, _heads(weight, d), beta=0, alpha=-1)
        return grad_weight, grad_operator


def dex_folded_weight(weight: torch.Tensor, operator: torch.Tensor) -> torch.Tensor:
    """o_proj's weight W (hidden, h * d), head h's columns W_h (hidden, d), and DEX's operator G (h, d, d), G_h =
    lambda_h f_D(I) -> W' with W'_h = W_h - W_h G_h^T (hidden, h * d): o_proj(O - O G) = O W'^T per head. In W's
    layout, so that o_proj's product reads it as it is and its gradient needs no transposed copy; forward and
    backward a batched product each (and the operator's gradient one more). G is taken in W's dtype."""
    return _DexFoldedWeight.apply(weight, operator.to(weight.dtype))


DEX_FOLD_BLOCK_R = 64  # rows of o_proj's weight per program
DEX_FOLD_SPLITS = 4  # programs per head in the backward, each over a quarter of the rows (hidden 2048: 128 programs)
DEX_FOLD_REDUCE_BLOCK = 32  # elements of f_D's gradient per program of the backward's sum over the programs' parts


def dex_folded_projection_applies(weight: torch.Tensor, combine: DexCombine) -> bool:
    """Whether `dex_folded_projection` takes o_proj's weight (hidden, h * d) and the layer's DEX term: the kernels'
    devices, f_D's weight (d, d) contiguous and of W's floating dtype, d a power of 2 of at least 16 (the tensor
    cores' least)."""
    operator = combine.operator
    d = operator.shape[-1]
    return (
        eager_kernels_run_on(weight)
        and weight.dim() == 2 and operator.shape == (d, d) and operator.is_contiguous()
        and weight.shape[1] == combine.head_mask.numel() * d
        and is_power_of_2(d) and d >= 16
        and weight.dtype == operator.dtype and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def _dex_fold_constexprs(weight: torch.Tensor, operator: torch.Tensor, anneal_steps: int) -> dict:
    """The fold kernels' constexprs but the products' precision (`_triton.dot_precision`)."""
    d = operator.shape[-1]
    return dict(ANNEALED=anneal_steps > 0, H=weight.shape[1] // d, D=d)


class _DexFoldedProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, operator, lambda_learn, head_mask, anneal_step, anneal_steps, lambda_init):
        weight = weight.contiguous()
        constexprs = _dex_fold_constexprs(weight, operator, anneal_steps)
        folded = torch.empty_like(weight)
        grid = (cdiv(weight.shape[0], DEX_FOLD_BLOCK_R), constexprs["H"])
        _dex_fold_fwd[grid](weight, operator, lambda_learn, head_mask, anneal_step, folded, weight.shape[0],
                            anneal_steps, lambda_init, **constexprs, BLOCK_R=DEX_FOLD_BLOCK_R,
                            PRECISION=dot_precision(weight.dtype))
        ctx.save_for_backward(weight, operator, lambda_learn, head_mask, anneal_step)
        ctx.anneal_steps, ctx.lambda_init = anneal_steps, lambda_init
        return folded

    @staticmethod
    def backward(ctx, grad):
        weight, operator, lambda_learn, head_mask, anneal_step = ctx.saved_tensors
        constexprs = _dex_fold_constexprs(weight, operator, ctx.anneal_steps)
        hidden, heads, d = weight.shape[0], constexprs["H"], constexprs["D"]
        rows_per_split = cdiv(cdiv(hidden, DEX_FOLD_SPLITS), DEX_FOLD_BLOCK_R) * DEX_FOLD_BLOCK_R
        splits = cdiv(hidden, rows_per_split)
        grad_weight = torch.empty_like(weight)
        # each program's terms of F's and lambda's gradients, summed by the second launch
        grad_f_parts = torch.empty((splits, heads, d, d), dtype=torch.float32, device=weight.device)
        grad_lambda_parts = torch.empty((splits, heads), dtype=torch.float32, device=weight.device)
        _dex_fold_bwd[(heads, splits)](
            weight, operator, lambda_learn, head_mask, anneal_step, grad.contiguous(), grad_weight, grad_f_parts,
            grad_lambda_parts, hidden, rows_per_split, ctx.anneal_steps, ctx.lambda_init, **constexprs,
            BLOCK_R=DEX_FOLD_BLOCK_R, PRECISION=dot_precision(weight.dtype),
        )
        grad_operator, grad_lambda = torch.empty_like(operator), torch.empty_like(lambda_learn)
        _dex_fold_bwd_reduce[(d * d // DEX_FOLD_REDUCE_BLOCK,)](  # d * d >= 256: whole blocks
            grad_f_parts, grad_lambda_parts, anneal_step, grad_operator, grad_lambda, ctx.anneal_steps,
            splits * heads, ANNEALED=constexprs["ANNEALED"], D=d, PARTS_POW2=next_power_of_2(splits * heads),
            BLOCK=DEX_FOLD_REDUCE_BLOCK,
        )
        return grad_weight, grad_operator, grad_lambda, None, None, None, None


def dex_folded_projection(weight: torch.Tensor, combine: DexCombine) -> torch.Tensor:
    """o_proj's weight W (hidden, h * d) with the layer's DEX term folded in (check `dex_folded_projection_applies`):
    W'_h = W_h - W_h M_h, M_h = lambda_h F in W's dtype, F f_D's weight (d, d) (so M_h = G_h^T of
    `dex_folded_weight`, G_h = lambda_h f_D(I)), lambda_h = lambda(t) mask_h in W's dtype (`DexLambda`), the products
    accumulated in float32 and rounded once. Gradients reach W, F and lambda_learn (through lambda(t)'s a =
    min(1, t/T)); the per-head sums of F's and lambda's gradients in float32."""
    return _DexFoldedProjection.apply(weight, combine.operator, combine.lambda_learn, combine.head_mask,
                                      combine.anneal_step, combine.anneal_steps, float(combine.lambda_init))
