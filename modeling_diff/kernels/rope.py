"""Rotary position embedding (RoPE) of the queries and keys: transformers' formula, and one Triton pass for it.

    apply_rope(query, key, cos, sin, fused) -> (query, key) rotated; query (B, L, Hq, d), key (B, L, Hk, d),
    cos and sin (B or 1, L, d) as transformers' rotary embedding gives them.

The reference is transformers' `apply_rotary_pos_emb` (`x * cos + rotate_half(x) * sin`, RoFormer arXiv
2104.09864, in Llama's half-split layout): about six elementwise kernels per tensor, each a pass over it, forward
and again backward. The Triton kernel (`triton_rope.py`) reads each head once and writes it once, in float32
arithmetic. The modules ask for it (`fused`) on the project's fast attention implementations; it applies on
CUDA in eager mode (Inductor fuses the reference under torch.compile), or under TRITON_INTERPRET=1 (tests).
"""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ._triton import cdiv, eager_kernels_run_on, is_power_of_2, needs_grad, next_power_of_2


def rope_kernel_applies(query, key, cos, sin) -> bool:
    half = query.shape[-1] // 2
    return (
        eager_kernels_run_on(query)
        and is_power_of_2(half) and query.shape[-1] == 2 * half == key.shape[-1] == cos.shape[-1]
        and cos.shape[0] in (1, query.shape[0]) and cos.shape == sin.shape
        and not (cos.requires_grad or sin.requires_grad)
        and all(t.stride(-1) == 1 for t in (query, key, cos, sin))
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool, dtype: torch.dtype):
    """One launch: x (B, L, H, d) -> rotated, contiguous, in `dtype`; `transpose` applies the transposed rotation
    (the backward)."""
    from .triton_rope import _rope

    batch, length, heads, dim = x.shape
    out = torch.empty(batch, length, heads, dim, dtype=dtype, device=x.device)
    block_h = min(next_power_of_2(heads), max(1, 4096 // dim))  # about 4K elements per program
    _rope[(batch * length, cdiv(heads, block_h))](
        x, cos, sin, out, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), length, heads,
        HALF=dim // 2, BLOCK_H=block_h, TRANSPOSE=transpose,
    )
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, dtype):
        ctx.save_for_backward(cos, sin)
        ctx.input_dtype = x.dtype
        return _rotate(x, cos, sin, transpose=False, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _rotate(grad, cos, sin, transpose=True, dtype=ctx.input_dtype), None, None, None


def _fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotated x in the dtype transformers' formula gives (x * cos promotes: a float32 cos under autocast)."""
    dtype = torch.promote_types(x.dtype, cos.dtype)
    if needs_grad(x):
        return _Rope.apply(x, cos, sin, dtype)
    return _rotate(x, cos, sin, transpose=False, dtype=dtype)  # decoding: no autograd node to build


def apply_rope(query, key, cos, sin, fused: bool):
    """See the module docstring. `fused`: take the Triton kernel where it applies."""
    if fused and rope_kernel_applies(query, key, cos, sin):
        return _fused_rope(query, cos, sin), _fused_rope(key, cos, sin)
    return apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)
