"""FlashAttention-4's kernels (the `flash-attn-4` package, Dao-AILab's `flash_attn.cute`, BSD-3-Clause) for the
attention calls of prefill and training, where the package is installed: `pip install "modeling_diff[flash-attn-4]"`.

Its Hopper kernels are FlashAttention-3's design written in NVIDIA's CuTe DSL: warp-specialized, a producer warp
loading K and V through TMA while consumer warpgroups run the products and the softmax, their registers split by
`setmaxnreg`. Triton 3.6 builds neither that split nor its overlap of exponentials with products for sm_90a
(benchmarks/RESULTS.md, "Warp specialization in Gluon"), and at head_dim 64 the exponentials bound attention as much
as the tensor cores do. The calls it takes are self-attention over a whole causal sequence: no mask beyond causal
(no padding), as many keys as queries, no dropout, no option only SDPA implements; in training at every length,
without gradients beyond 4096 queries. Everything else, and every call where the package is absent or
`MODELING_DIFF_FLASH_ATTN_4=0` is set, stays where it was (SDPA, V2's flash-diff kernel).

Layouts: transformers' attention functions get (B, H, L, d) views of the projections' (B, L, H * d) outputs, whose
transposes are the (B, L, H, d) that FlashAttention takes: no copy either way; GQA without repeating the kv heads.
"""

import functools
import importlib.metadata
import os

import torch

from ._triton import TRITON_INTERPRETING, needs_grad

ENABLED = os.environ.get("MODELING_DIFF_FLASH_ATTN_4", "1") != "0"
DISTRIBUTION = "flash-attn-4"
# Compute capabilities whose kernels the package has, and the head sizes they take (its `_validate_head_dims`).
_ARCHITECTURES = (9, 10, 11)
_MAX_HEAD_DIM = 128
# Without gradients (prefill) it takes calls of more queries than this: on an H100, one layer's forward at 2048 x 4
# tokens measured slower on it than on SDPA (DEX 0.81 against 0.58 ms) and than V2's flash-diff kernel (0.80 against
# 0.76), at 8192 and 32768 faster (DEX 0.86 / 8.98 against 0.94 / 10.94 ms; V2 1.43 / 17.8 against 1.53 / 21.8);
# in training it measured level or faster at every length (benchmarks/RESULTS.md, "FlashAttention-4").
MAX_QUERIES_WITHOUT_GRADIENTS_ELSEWHERE = 4096


@functools.cache
def flash_attn_4_installed() -> bool:
    """Whether the `flash-attn-4` distribution is installed (read from its metadata: importing it loads CUTLASS's
    DSL, seconds)."""
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@functools.cache
def _gpu_has_kernels(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] in _ARCHITECTURES


def _device_has_kernels(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is on a GPU the package has kernels for."""
    if not tensor.is_cuda:
        return False
    return _gpu_has_kernels(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def flash_attn_4_runs_on(query: torch.Tensor) -> bool:
    """Whether FlashAttention-4 can run here: the package installed and not turned off, a GPU it has kernels for,
    and neither Triton's interpreter (CI's CPU runs) nor torch.compile's tracing (the package's autograd Function is
    not traceable: a compiled model keeps SDPA)."""
    return (
        ENABLED
        and not TRITON_INTERPRETING
        and flash_attn_4_installed()
        and not torch.compiler.is_compiling()
        and _device_has_kernels(query)
    )


def plain_causal_self_attention(
    query: torch.Tensor,  # (B, Hq, L, d)
    key: torch.Tensor,  # (B, Hkv, S, d)
    value: torch.Tensor,  # (B, Hkv, S, dv)
    attention_mask: torch.Tensor | None,
    dropout: float,
) -> bool:
    """Whether a call is what FlashAttention-4 is used for: causal self-attention over the whole sequence (no mask:
    transformers passes none for causal attention without padding; L == S), no dropout, bf16 or fp16, kv heads that
    divide the query heads, head sizes multiples of 8 up to 128."""
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    return (
        attention_mask is None
        and dropout == 0.0
        and query.dtype in (torch.bfloat16, torch.float16)
        and key.dtype == value.dtype == query.dtype
        and query.shape[-2] == key.shape[-2]
        and query.shape[1] % key.shape[1] == 0
        and head_dim % 8 == 0 and value_dim % 8 == 0
        and head_dim <= _MAX_HEAD_DIM and value_dim <= _MAX_HEAD_DIM
    )


def flash_attn_4_applies(query, key, value, attention_mask, dropout: float) -> bool:
    """Whether FlashAttention-4 takes this attention call (shapes as `plain_causal_self_attention`'s): where autograd
    records it (a backward follows), and else from MAX_QUERIES_WITHOUT_GRADIENTS_ELSEWHERE + 1 queries on."""
    return (
        plain_causal_self_attention(query, key, value, attention_mask, dropout)
        and (query.shape[-2] > MAX_QUERIES_WITHOUT_GRADIENTS_ELSEWHERE or needs_grad(query, key, value))
        and flash_attn_4_runs_on(query)
    )


def flash_attn_4_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal attention of query (B, Hq, L, d) over key and value (B, Hkv, L, d / dv) -> (B, L, Hq, dv), the layout
    transformers' attention functions return. Under `torch.use_deterministic_algorithms(True)` the backward is the
    package's deterministic one (dQ summed in a fixed order)."""
    try:  # in a try block: transformers' remote-code loader requires every import outside one (of a Hub export's
        # files) to be installed; flash_attn_4_runs_on found the distribution, so this import succeeds
        from flash_attn.cute import flash_attn_func
    except ImportError as error:
        raise ImportError(f"flash-attn-4 is installed but does not import ({error}); `MODELING_DIFF_FLASH_ATTN_4=0` "
                          "leaves attention on SDPA") from error

    out, _ = flash_attn_func(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scaling, causal=True,
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    return out
