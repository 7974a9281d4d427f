"""Rotary position embedding (RoPE) of the queries and keys: transformers' formula, and one Triton pass for it.

    apply_rope(query, key, cos, sin, fused) -> (query, key) rotated; query (B, L, Hq, d), key (B, L, Hk, d),
    cos and sin (B or 1, L, d) as transformers' rotary embedding gives them.
    rope_cos_sin(position_ids (B, L), inv_freq (d / 2,), scaling, dtype) -> cos, sin (B, L, d): transformers'
    rotary embedding's forward (`LlamaRotaryEmbedding`, the reference) in one launch, for decoding steps.

The reference is transformers' `apply_rotary_pos_emb` (`x * cos + rotate_half(x) * sin`, RoFormer arXiv
2104.09864, in Llama's half-split layout): about six elementwise kernels per tensor, each a pass over it, forward
and again backward. The Triton kernel (`triton_rope.py`) reads each head once and writes it once, in float32
arithmetic, the query's and the key's heads in one launch. The modules ask for it (`fused`) on the project's
fast attention implementations; it applies on CUDA in eager mode (Inductor fuses the reference under
torch.compile), or under TRITON_INTERPRET=1 (tests).
"""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ._triton import (
    TRITON_AVAILABLE, cdiv, dependent_launch, eager_kernels_run_on, is_power_of_2, needs_grad, next_power_of_2,
    promoted_dtype,
)

if TRITON_AVAILABLE:
    from .triton_rope import _rope, _rope_cos_sin

MAX_POSITIONS = 64  # tokens of a step that `rope_cos_sin` takes (decoding steps, as the other step kernels)


def rope_kernel_applies(query, key, cos, sin) -> bool:
    half = query.shape[-1] // 2
    return (
        eager_kernels_run_on(query)
        and is_power_of_2(half) and query.shape[-1] == 2 * half == key.shape[-1] == cos.shape[-1]
        and query.dtype == key.dtype and query.shape[:2] == key.shape[:2]
        and cos.shape[0] in (1, query.shape[0]) and cos.shape == sin.shape
        and not (cos.requires_grad or sin.requires_grad)
        and all(t.stride(-1) == 1 for t in (query, key, cos, sin))
    )


def _rotate(query, key, cos, sin, transpose: bool, dtype: torch.dtype, pdl: bool = False):
    """One launch: query (B, L, Hq, d) and key (B, L, Hk, d) -> both rotated, contiguous, in `dtype`; `transpose`
    applies the transposed rotation (the backward); `pdl`: a dependent launch (decoding steps)."""
    batch, length, q_heads, dim = query.shape
    k_heads = key.shape[2]
    out_q = torch.empty(batch, length, q_heads, dim, dtype=dtype, device=query.device)
    out_k = torch.empty(batch, length, k_heads, dim, dtype=dtype, device=query.device)
    block_h = min(next_power_of_2(max(q_heads, k_heads)), max(1, 4096 // dim))  # about 4K elements per program
    _rope[(batch * length, cdiv(q_heads, block_h) + cdiv(k_heads, block_h))](
        query, key, cos, sin, out_q, out_k, *query.stride()[:3], *key.stride()[:3], *out_q.stride()[:3],
        *out_k.stride()[:3], cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
        length, q_heads, k_heads, HALF=dim // 2, BLOCK_H=block_h, TRANSPOSE=transpose, PDL=pdl, launch_pdl=pdl,
    )
    return out_q, out_k


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, cos, sin, dtype):
        ctx.save_for_backward(cos, sin)
        ctx.input_dtype = query.dtype
        return _rotate(query, key, cos, sin, transpose=False, dtype=dtype)

    @staticmethod
    def backward(ctx, grad_query, grad_key):
        cos, sin = ctx.saved_tensors
        grad_query, grad_key = (g if g.stride(-1) == 1 else g.contiguous() for g in (grad_query, grad_key))
        return *_rotate(grad_query, grad_key, cos, sin, transpose=True, dtype=ctx.input_dtype), None, None, None


def apply_rope(query, key, cos, sin, fused: bool):
    """See the module docstring. `fused`: take the Triton kernel where it applies."""
    if fused and rope_kernel_applies(query, key, cos, sin):
        dtype = promoted_dtype(query.dtype, cos.dtype)  # as x * cos: a float32 cos under autocast gives float32
        if needs_grad(query, key):
            return _Rope.apply(query, key, cos, sin, dtype)
        # decoding: no autograd node to build
        return _rotate(query, key, cos, sin, transpose=False, dtype=dtype, pdl=dependent_launch(query, query.shape[0] * query.shape[1]))
    return apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)


def rope_cos_sin_applies(x: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor) -> bool:
    """Whether `rope_cos_sin` takes a step: at most MAX_POSITIONS integer positions where the kernels run (eager, on
    CUDA or the interpreter), float32 frequencies on that device, a power-of-two count of them."""
    return (
        eager_kernels_run_on(x)
        and position_ids.numel() <= MAX_POSITIONS and position_ids.dim() == 2
        and not position_ids.is_floating_point() and not position_ids.is_complex()
        and inv_freq.is_floating_point() and inv_freq.dim() == 1 and is_power_of_2(inv_freq.shape[0])
        and position_ids.device == inv_freq.device == x.device
    )


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, L, d) of the positions (B, L), d = 2 x inv_freq's length, in `dtype` (check
    `rope_cos_sin_applies` first): cos(p f) and sin(p f) times `scaling` for each frequency f, both halves alike."""
    half = inv_freq.shape[0]
    positions = position_ids.reshape(-1).contiguous()
    cos = torch.empty(*position_ids.shape, 2 * half, dtype=dtype, device=position_ids.device)
    sin = torch.empty_like(cos)
    tokens = positions.shape[0]
    if tokens:
        block_t = max(1, min(next_power_of_2(tokens), 4096 // half))  # about 4K angles per program
        pdl = dependent_launch(positions, tokens)
        _rope_cos_sin[(cdiv(tokens, block_t),)](
            positions, inv_freq, cos, sin, float(scaling), tokens, HALF=half, BLOCK_T=block_t, PDL=pdl,
            launch_pdl=pdl,
        )
    return cos, sin
