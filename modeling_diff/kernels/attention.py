"""The project's attention implementations, `"diff_triton"` and `"fused_diff"`: Triton where it beats SDPA.

`diff_triton_attention_forward` has the signature of transformers' attention functions, so every attention
module of modeling_diff calls it like `sdpa`. Decoding steps (a few query tokens against the cache) go to the
split-KV Triton kernel, which reads each cache entry once; longer queries (prefill, training) go to
FlashAttention-4's kernels where the package is installed and the call is plain causal self-attention
(`flash_attn_4.py`), else to transformers' SDPA call, which uses FlashAttention or cuDNN with GQA. On CUDA, `sdpa`
is routed here automatically (see `resolve`).

The modules themselves decide whether to bypass the call for the flash-diff kernel (`flash_diff.py`):
under `diff_triton` where it measured faster than SDPA (V1), under `fused_diff` for every differential mode.
"""

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ._triton import triton_available
from .decode import decode_attention, decode_kernel_applies
from .flash_attn_4 import flash_attn_4_applies, flash_attn_4_attention

NAME = "diff_triton"
FUSED_DIFF = "fused_diff"
# Options of transformers' attention functions that the Triton kernels do not implement.
_EXTRA_OPTIONS = ("softcap", "sliding_window", "position_bias", "s_aux")


def has_extra_options(kwargs: dict) -> bool:
    """Whether an attention call asks for an option that only SDPA (or eager) implements."""
    return any(kwargs.get(name) is not None for name in _EXTRA_OPTIONS)


def diff_triton_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (B, Hq, L, Dq)
    key: torch.Tensor,  # (B, Hkv, S, Dq)
    value: torch.Tensor,  # (B, Hkv, S, Dv)
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if not has_extra_options(kwargs) and decode_kernel_applies(query, key, value, attention_mask, dropout):
        return decode_attention(query, key, value, attention_mask, scaling), None  # (B, L, Hq, Dv)
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if causal and not has_extra_options(kwargs) and flash_attn_4_applies(query, key, value, attention_mask, dropout):
        return flash_attn_4_attention(query, key, value, scaling), None  # (B, L, Hq, Dv)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def resolve(implementation: str, query: torch.Tensor) -> str:
    """The implementation a module actually uses: `sdpa` on CUDA becomes `diff_triton` when triton is there."""
    if implementation == "sdpa" and query.is_cuda and triton_available():
        return NAME
    return implementation


def uses_fast_kernels(implementation: str) -> bool:
    """Whether an implementation as `resolve` gives it is one of the project's (`diff_triton`, which `sdpa` is on
    CUDA, or `fused_diff`): then RoPE and the decoder's RMSNorm take their Triton kernels too where they apply."""
    return implementation in (NAME, FUSED_DIFF)


def register() -> None:
    """Make `attn_implementation="diff_triton"` and `"fused_diff"` valid choices for transformers (attention and
    mask); `fused_diff` calls the same function for what the kernel does not cover (DEX, decoding steps)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for name in (NAME, FUSED_DIFF):
        AttentionInterface.register(name, diff_triton_attention_forward)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
