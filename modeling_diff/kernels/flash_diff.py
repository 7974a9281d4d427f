"""Flash-diff attention: a differential head's two softmax maps and their combine in one Triton kernel.

    flash_diff_attention(query, key, value, mask, mu, scale, norm=None, norm_scale=1.0, o_proj=None)
        -> (B, L, h, DV), or o_proj of it (B, L, hidden)

- query (B, L, h, 2, DQK): Q1 and Q2 of every differential head (any strides, the last dim contiguous);
- key (B, h_kv, S, 2*DQK) = K1|K2 (V1) or (B, h_kv, S, DQK), one key head for both maps (V2);
- value (B, h_kv, S, DV); head i reads kv head i // (h / h_kv); key and value as the projections lay them out (a
  token's heads side by side: (B, S, h_kv, .) transposed), which the kernels read through TMA, or copied into it;
- V1: mu = lambda (a float32 scalar tensor), norm = the subln RMSNorm, norm_scale = 1 - lambda_init;
  V2: mu = the per-token noise weight (B, L, h), norm = None.

It computes what the modules' plain path computes (one attention call, then `combine.v1_combine` or `v2_combine`),
causal as transformers' SDPA call means it without a mask (`masks.py`), a bool mask (B or 1, 1, L, S) deciding
where there is one, forward and backward. Against that path it reads each K/V tile once for both maps, spends DQK
(not 2*DQK) on V1's Q.K, and writes and saves no zero-padded queries; in training it saves the pair (O1, O2) per
head for the backward, and given o_proj it keeps no combined heads for o_proj's weight gradient either. The
reference is the plain path itself (`tests/test_kernels.py` checks both against the formula).
"""

import torch
import torch.nn.functional as F
from torch import nn

from ._modules import linear_in_product_dtype, recomputed_linear_backward
from ._triton import TRITON_AVAILABLE, TRITON_INTERPRETING, cdiv, eager_kernels_run_on, is_power_of_2, needs_grad
from .combine import v1_combine_backward, v1_combine_rows, v2_combine_backward, v2_combine_rows
from .masks import causal_offset, kernel_mask

if TRITON_AVAILABLE:
    from .triton_flash_diff import (
        DKDV_FIXED, DKDV_WHOLE_TILES_OF, DQ_FIXED, FWD_FIXED, TensorDescriptor, flash_diff_bwd_dkdv, flash_diff_bwd_dq,
        flash_diff_fwd, keys_bucket, tile_descriptors,
    )

MIN_QUERY_TOKENS = 16  # fewer new tokens without gradients: a decoding step, for the split-KV decode kernel


def flash_diff_applies(query, key, value, mask, dropout: float) -> bool:
    """Shapes, dtypes and options the kernel covers; the modules take their plain path for everything else (a float32
    model under autocast: RoPE's float32 cos and sin leave q and k in float32 and v in autocast's dtype)."""
    dims = (query.shape[-1], value.shape[-1])
    return (
        eager_kernels_run_on(query)
        and (query.dtype in (torch.bfloat16, torch.float16) or TRITON_INTERPRETING)
        and query.dtype == key.dtype == value.dtype
        and dropout == 0.0
        and (needs_grad(query, key, value) or query.shape[1] >= MIN_QUERY_TOKENS)
        and all(n >= 16 and is_power_of_2(n) for n in dims)
        and key.shape[-1] in (query.shape[-1], 2 * query.shape[-1])
        and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1))
    )


def _tokens_as_rows(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (B, h_kv, S, d) reads as one matrix (B * S, h_kv * d) through TMA, as the projections lay out
    their outputs: a token's heads side by side in one row, rows a fixed stride apart through every sequence, 16-byte
    aligned (TMA's unit)."""
    batch, heads, tokens, width = tensor.shape
    batch_stride, head_stride, row, last = tensor.stride()
    return (last == 1 and (head_stride == width or heads == 1) and row >= heads * width
            and batch_stride == tokens * row and tensor.data_ptr() % 16 == 0
            and row * tensor.element_size() % 16 == 0)


def _with_tokens_as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as it is if `_tokens_as_rows`, else a copy laid out so (a clone: `contiguous` would keep a contiguous
    tensor off the alignment as it is)."""
    if _tokens_as_rows(tensor):
        return tensor
    return tensor.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)


def _key_descriptors(fixed: dict, key: torch.Tensor, value: torch.Tensor, dqk: int) -> list:
    """TMA descriptors of key and value (B, h_kv, S, .) as the matrices (B * S, h_kv * .) (`_tokens_as_rows`),
    blocks of a tile of keys by dqk (key) or the value's width: `tile_descriptors` sets the tile's rows, from `fixed`
    (the interpreter's config) here; on a GPU, autotuning's pre-hook sets each config's."""
    descriptors = {
        name: TensorDescriptor(t, [t.shape[0] * t.shape[2], t.shape[1] * t.shape[3]], [t.stride(2), 1], [1, width])
        for name, t, width in (("Kd", key, dqk), ("Vd", value, value.shape[-1]))
    }
    if fixed:
        tile_descriptors({**descriptors, **fixed})
    return list(descriptors.values())


def _forward(query, key, value, mask, mu, norm_weight, eps, norm_scale, scale, save):
    batch, length, heads, _, dqk = query.shape
    kv_heads, kv_length, dv = key.shape[1], key.shape[2], value.shape[-1]
    rows = batch * length * heads
    device = query.device
    y = torch.empty(batch, length, heads, dv, dtype=query.dtype, device=device)
    pairs = torch.empty(rows, 2, dv, dtype=query.dtype, device=device) if save else y
    lse = torch.empty(rows, 2, dtype=torch.float32, device=device) if save else y
    rstd = torch.empty(rows, dtype=torch.float32, device=device) if save and norm_weight is not None else y
    mask_arg, mask_strides = kernel_mask(mask, query)
    grid = lambda meta: (batch * heads, cdiv(length, meta["BLOCK_M"]))  # noqa: E731
    keys, values = _key_descriptors(FWD_FIXED, key, value, dqk)
    flash_diff_fwd[grid](
        query, keys, values, mask_arg, mu, query if norm_weight is None else norm_weight, y, pairs, lse, rstd,
        *query.stride()[:4], *mask_strides,
        heads, length, kv_length, causal_offset(length, kv_length, mask is not None), eps, norm_scale,
        KEYS_BUCKET=keys_bucket(kv_length),
        SCALE=scale, GROUP=heads // kv_heads, DQK=dqk, DV=dv, SPLIT_K=key.shape[-1] == 2 * dqk,
        V1=norm_weight is not None,
        HAS_MASK=mask is not None, SAVE=save, **FWD_FIXED,
    )
    return y, pairs, lse, rstd


def _row_terms(lse, delta, row_weight, batch: int, length: int, heads: int) -> torch.Tensor:
    """(B, H, 4 or 5, L) float32 for the backward kernels: each query row's logsumexp and D term of both maps (lse and
    delta (B*L*H, 2)) and, for V2, its noise weight (row_weight, B*L*H values), head-major, so that the rows of a
    tile are contiguous for each term (the dK/dV kernel reads them once a query tile)."""
    parts = [lse.view(batch, length, heads, 2), delta.view(batch, length, heads, 2)]
    if row_weight is not None:
        parts.append(row_weight.reshape(batch, length, heads, 1).float())
    return torch.cat(parts, dim=-1).permute(0, 2, 3, 1).contiguous()


def _combined_rows(pairs, mu, norm_weight, eps, norm_scale):
    """The combined heads (R, DV) again from the saved pairs, as the forward's epilogue computed them."""
    if norm_weight is not None:
        return v1_combine_rows(pairs, mu, norm_weight, eps, norm_scale)[0]
    return v2_combine_rows(pairs, mu.reshape(-1))


class _FlashDiff(torch.autograd.Function):
    """With o_proj's weight (and bias), o_proj of the combined heads: then the combined heads are not kept for
    o_proj's weight gradient (the backward computes them again from the pairs, one elementwise pass). o_proj's
    product runs in the weight's dtype (the caller casts it to the dtype F.linear would use under autocast), the
    combined heads cast to it, and their gradient cast back, as autocast's casts do."""

    @staticmethod
    def forward(ctx, query, key, value, mask, mu, norm_weight, eps, norm_scale, scale, o_weight, o_bias):
        y, pairs, lse, rstd = _forward(query, key, value, mask, mu, norm_weight, eps, norm_scale, scale, save=True)
        rstd = rstd if norm_weight is not None else None  # V2 has none (the launch's placeholder is y itself)
        ctx.save_for_backward(query, key, value, mask, mu, norm_weight, pairs, lse, rstd, o_weight)
        ctx.eps, ctx.norm_scale, ctx.scale = eps, norm_scale, scale
        if o_weight is None:
            return y
        return F.linear(y.flatten(-2).to(o_weight.dtype), o_weight, o_bias)  # (B, L, hidden)

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, mask, mu, norm_weight, pairs, lse, rstd, o_weight = ctx.saved_tensors
        batch, length, heads, _, dqk = query.shape
        kv_heads, kv_length, dv = key.shape[1], key.shape[2], value.shape[-1]
        grad_o_weight = grad_o_bias = None
        if o_weight is None:
            grad_rows = grad_out.reshape(-1, dv)
        else:  # the combined heads again, for o_proj's weight
            grad_rows, grad_o_weight, grad_o_bias = recomputed_linear_backward(
                grad_out, o_weight,
                lambda: _combined_rows(pairs, mu, norm_weight, ctx.eps, ctx.norm_scale).to(o_weight.dtype),
                *ctx.needs_input_grad[9:11],
            )
            grad_rows = grad_rows.view(-1, dv).to(query.dtype)  # (R, DV): the gradient of the combined heads
        if norm_weight is not None:  # V1: through subln and lambda to g = dO1 (dO2 = -lambda g)
            grad_o1, grad_mu, grad_norm, delta = v1_combine_backward(
                pairs, mu, norm_weight, rstd, grad_rows, ctx.norm_scale, for_flash=True
            )
        else:  # V2: dO1 = grad y, dO2 = -weight grad y
            grad_norm = None
            grad_o1 = grad_rows.contiguous()
            _, grad_weight, delta = v2_combine_backward(pairs, mu.reshape(-1), grad_o1, for_flash=True)
            grad_mu = grad_weight.view(mu.shape)
        grad_q, grad_k, grad_v = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        mask_arg, mask_strides = kernel_mask(mask, query)
        terms = _row_terms(lse, delta, None if norm_weight is not None else mu, batch, length, heads)
        common = dict(
            SCALE=ctx.scale, GROUP=heads // kv_heads, DQK=dqk, DV=dv, SPLIT_K=key.shape[-1] == 2 * dqk,
            V1=norm_weight is not None, HAS_MASK=mask is not None, KEYS_BUCKET=keys_bucket(kv_length),
        )
        q_strides = query.stride()[:4]
        offset = causal_offset(length, kv_length, mask is not None)
        flash_diff_bwd_dkdv[lambda meta: (batch * kv_heads, cdiv(kv_length, meta["BLOCK_N"]))](
            query, key, value, mask_arg, mu, grad_o1, terms, grad_k, grad_v,
            *q_strides, *key.stride()[:3], *value.stride()[:3], *mask_strides,
            *grad_k.stride()[:3], *grad_v.stride()[:3],
            heads, length, kv_length, offset, **common, WHOLE_TILES=length % DKDV_WHOLE_TILES_OF == 0, **DKDV_FIXED,
        )
        keys, values = _key_descriptors(DQ_FIXED, key, value, dqk)
        flash_diff_bwd_dq[lambda meta: (batch * heads, cdiv(length, meta["BLOCK_M"]))](
            query, keys, values, mask_arg, mu, grad_o1, terms, grad_q,
            *q_strides, *mask_strides,
            *grad_q.stride()[:4],
            heads, length, kv_length, offset, **common, **DQ_FIXED,
        )
        return grad_q, grad_k, grad_v, None, grad_mu, grad_norm, None, None, None, grad_o_weight, grad_o_bias


def flash_diff_attention(query, key, value, mask, mu, scale: float, norm: nn.Module | None = None,
                         norm_scale: float = 1.0, o_proj: nn.Module | None = None) -> torch.Tensor:
    """See the module docstring. Returns the combined head outputs (B, L, h, DV), or with `o_proj` its output
    (B, L, hidden): in training with a plain Linear, in the kernel's autograd node, which then keeps no combined
    heads for o_proj's backward."""
    query = query if query.stride(-1) == 1 else query.contiguous()
    key, value = _with_tokens_as_rows(key), _with_tokens_as_rows(value)  # for the TMA descriptors
    mask = None if mask is None else kernel_mask(mask, query)[0]  # uint8 once, for the forward and the backward
    norm_weight = None if norm is None else norm.weight
    eps = 0.0 if norm is None else norm.variance_epsilon
    mu = mu.float() if norm is not None else mu.contiguous()
    inputs = (query, key, value, mu, norm_weight)
    if needs_grad(*inputs, None if o_proj is None else o_proj.weight):
        o_params = None if o_proj is None else linear_in_product_dtype(query, o_proj)
        if o_params is not None:  # o_proj in the node, its product in F.linear's dtype (autocast's, where it casts)
            return _FlashDiff.apply(query, key, value, mask, mu, norm_weight, eps, norm_scale, scale, *o_params)
        y = _FlashDiff.apply(query, key, value, mask, mu, norm_weight, eps, norm_scale, scale, None, None)
    else:
        y = _forward(query, key, value, mask, mu, norm_weight, eps, norm_scale, scale, save=False)[0]
    return y if o_proj is None else o_proj(y.flatten(-2))
