"""Fast paths of modeling_diff: Triton kernels next to their plain PyTorch references.

- `combine.py`: the differential combine after the attention call (V1 lambda + subln, V2 noise weight),
  fused into one Triton pass forward and backward, and V1's lambda in one launch each way (`triton_combine.py`).
- `flash_diff.py`: both softmax maps of a differential head and the combine in one flash-attention kernel
  (`triton_flash_diff.py`), forward and backward, for V1 and V2 prefill and training.
- `rope.py`: the rotary embedding of queries and keys in one Triton launch for both, and a decoding step's cos and
  sin in one (`triton_rope.py`).
- `rmsnorm.py`: the decoder's RMSNorm in one Triton pass forward and one backward (`triton_rmsnorm.py`), and
  without gradients the residual add before it in the same pass.
- `swiglu.py`: the decoder's SwiGLU MLP in training, its activation computed again in the backward instead of
  kept, and silu(gate) * up alone for MLPs of wrapped layers (`triton_swiglu.py`).
- `projection.py`: the Linear maps of a decoding step in fewer launches: q, k, v (and V2's lambda_proj) in one,
  the MLP's gate and up with silu(gate) * up in one, o_proj and down_proj split along their input, and q, k, v
  split with their sum and RoPE in one pass (`triton_projection.py`).
- `triton_launch.py`: programmatic dependent launch (Hopper) in the decoding step's kernels.
- `cache_write.py`: a decoding step's keys and values into a StaticCache layer, its length advanced, in one
  launch (`triton_cache_write.py`), where transformers' update issues five; in steps of at most 16 tokens in the
  projections' launch instead.
- `decode.py`: split-KV attention for decoding steps, one read of the KV cache per step, with each mode's
  differential term in its reduce (`triton_decode.py`).
- `greedy.py`: the greedy choice of a decoding step, argmax over each row's scores, in one launch
  (`triton_greedy.py`).
- `masks.py`: what the kernels take of transformers' attention mask, and a StaticCache step's mask in one
  comparison where transformers' takes about eight launches.
- `flash_attn_4.py`: FlashAttention-4's kernels (the optional `flash-attn-4` package) for plain causal
  self-attention in prefill and training, where installed.
- `attention.py`: the attention implementations `"diff_triton"` (chosen automatically for `sdpa` on CUDA) and
  `"fused_diff"` that use them.

triton is optional: it is imported only where it is installed (`_triton.TRITON_AVAILABLE`), and without it
every path is plain PyTorch, so the model (and its Hub export) loads anywhere.
"""

from ._modules import (
    GLOBAL_MODULE_HOOKS, global_module_hooks, is_plain_linear, is_plain_norm, keep_own_forward, runs_own_forward,
)
from ._triton import needs_grad, triton_available
from .attention import (
    FUSED_DIFF, NAME as DIFF_TRITON, diff_triton_attention_forward, has_extra_options, register, resolve,
    uses_fast_kernels,
)
from .cache_write import check_static_cache_fits, mark_written, projection_cache_layer, update_cache, written_layer
from .combine import (
    dex_folded_projection, dex_folded_projection_applies, dex_folded_weight, differential_lambda, v1_combine,
    v2_combine, v2_combine_projected,
)
from .decode import DexCombine, V1Combine, V2Combine, combined_decode_applies, combined_decode_attention
from .flash_attn_4 import flash_attn_4_applies
from .flash_diff import flash_diff_applies, flash_diff_attention
from .greedy import greedy_step, greedy_tokens
from .masks import static_step_mask
from .projection import (
    gated_projection, gated_projection_applies, linear_maps, rotated_projections, rotated_projections_apply,
    split_linear, split_linear_applies,
)
from .rmsnorm import add_rms_norm, add_rms_norm_applies, rms_norm, rms_norm_kernel_applies
from .rope import apply_rope, rope_cos_sin, rope_cos_sin_applies
from .swiglu import silu_mul, silu_mul_applies, swiglu_mlp, swiglu_mlp_applies

register()

__all__ = [
    "DIFF_TRITON", "FUSED_DIFF", "GLOBAL_MODULE_HOOKS", "DexCombine", "V1Combine", "V2Combine", "add_rms_norm",
    "add_rms_norm_applies",
    "apply_rope", "check_static_cache_fits", "combined_decode_applies", "combined_decode_attention",
    "dex_folded_projection", "dex_folded_projection_applies", "dex_folded_weight", "differential_lambda",
    "diff_triton_attention_forward", "flash_attn_4_applies",
    "flash_diff_applies", "flash_diff_attention", "gated_projection", "gated_projection_applies", "global_module_hooks",
    "greedy_step", "greedy_tokens",
    "has_extra_options", "is_plain_linear", "is_plain_norm", "keep_own_forward", "linear_maps", "mark_written",
    "needs_grad",
    "projection_cache_layer", "resolve", "rms_norm", "rms_norm_kernel_applies", "rope_cos_sin", "rope_cos_sin_applies",
    "rotated_projections", "rotated_projections_apply", "silu_mul", "silu_mul_applies", "runs_own_forward",
    "split_linear", "split_linear_applies", "static_step_mask", "swiglu_mlp", "swiglu_mlp_applies", "triton_available",
    "update_cache", "uses_fast_kernels", "v1_combine", "v2_combine", "v2_combine_projected", "written_layer",
]
