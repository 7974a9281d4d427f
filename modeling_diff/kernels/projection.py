"""The Linear maps of a decoding step in fewer, fuller launches: q, k, v (and V2's lambda_proj) in one, the MLP's
gate and up with silu(gate) * up in one, and a Linear map alone (o_proj, down_proj) split along its input width
(`triton_projection.py`).

A decoding step reads every weight once for a handful of tokens, so its speed is the bytes a launch keeps in
flight. cuBLAS's kernels for one token measured 0.4 TB/s on the ~1.1B model's k and v (2 MB each) and 1.5 TB/s
on q and o (8 MB), against a 4.2 TB/s copy (benchmarks/RESULTS.md); one launch over q, k and v reads 12 MB with
every program of the GPU busy, and the gated one reads gate and up side by side and writes only silu(gate) * up,
not gate, up and the product. The reference is the layers' own forward (F.linear and LlamaMLP's activation).

    linear_maps(x (..., K), *linears, fused) -> each linear(x), (..., N_i)
    gated_projection(x (..., K), gate, up) -> silu(gate(x)) * up(x), (..., I)
    split_linear(x (..., K), linear, residual=None) -> linear(x) (+ residual), (..., N)

A weight alone has too few row blocks for the GPU (o_proj's and down_proj's 2048 rows are 32 programs of 64 rows
for 132 multiprocessors), so its products are split along K into float32 partials, in steps of at most 16 tokens.
The last program of each row block to finish (a ticket each: `_triton.tickets_of`) sums the block's parts in the same
launch, and adds the decoder's residual (`residual + down_proj(x)`) or applies RoPE (q and k). cuBLAS takes o_proj
at 1 token in 5.2 us and down_proj in 11.3 (12.5 with the residual add); the split products with a second launch for
their sum took 3.5 and 8.8 us (benchmarks/pdl_bench.py on the H200, with PDL), and the sum in the products' launch
took a batch-1 step of the ~1.1B models 0.01-0.015 ms further (benchmarks/RESULTS.md).

The kernels take x where `few_rows_apply`: no gradient, on CUDA of compute capability 8.0+ (or the interpreter)
outside torch.compile, at most MAX_ROWS tokens of a 16-bit dtype; and they read plain bias-free Linear layers of
its dtype (`kernel_reads`). Every other layer runs its own forward, so PEFT's LoRA layers, tensor-parallel or
quantized layers and hooks keep their behaviour. Block sizes: what measured fastest on the H200 (`benchmarks/projection_bench.py --sweep`).
"""

import functools

import torch
from torch import nn

from ._modules import is_plain_linear, shared_input_linears, shared_input_linears_apply
from ._triton import (
    TRITON_AVAILABLE, TRITON_INTERPRETING, cdiv, dependent_launch, eager_kernels_run_on, next_power_of_2,
    shared_memory, sm_count, tickets_of,
)

if TRITON_AVAILABLE:
    from .triton_projection import _gated_projection, _projections

MAX_ROWS = 64  # tokens of a step the kernels take (x padded to a power of two >= 16 rows on the tensor cores)
MAX_WEIGHTS = 4  # weights of one `_projections` launch
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _tensor_cores_take_16_bit(device: torch.device) -> bool:
    """Whether tl.dot takes bfloat16 here: compute capability 8.0 (Ampere) or later, or the interpreter."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)


def few_rows_apply(x: torch.Tensor) -> bool:
    """Whether the kernels take this input (see the module docstring); the cheap checks first."""
    return (
        not torch.is_grad_enabled()
        and eager_kernels_run_on(x)
        and type(x) is torch.Tensor
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and (x.dtype in KERNEL_DTYPES or TRITON_INTERPRETING)
        and x.shape[-1] % 16 == 0
        and _tensor_cores_take_16_bit(x.device)
    )


def kernel_reads(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether the kernels can read this layer's weight for x: a plain bias-free Linear of x's dtype and device."""
    if not is_plain_linear(layer) or layer._parameters.get("bias") is not None:
        return False
    weight = layer._parameters["weight"]
    return weight.dtype == x.dtype and weight.get_device() == x.get_device() and weight.is_contiguous()


def block_k(width: int, block_n: int) -> int:
    """The reduction's step: about 16K weight elements per program and step (what measured fastest on the H200,
    `benchmarks/projection_bench.py --sweep`), a power of two dividing the width (the loop has no mask)."""
    return min(16384 // block_n, width & -width)


def pipeline_stages(block_m: int, weight_rows: int, block_k: int, x: torch.Tensor, most: int = 4) -> int:
    """Loads in flight per program: `most` (4 measured fastest on the H200), fewer where x's and the weights' tiles
    would not fit in 90% of the device's shared memory (the rest for Triton's own scratch)."""
    stage = (block_m + weight_rows) * block_k * x.element_size()
    return max(1, min(most, int(0.9 * shared_memory(x.device)) // stage))


def launch_projections(rows, weights, y, block_n: int, step: int, stages: int, warps: int = 4, split: int = 1, *,
                       out=None, tickets=None, residual=None, rope=None, cache=None) -> None:
    """One `_projections` launch: rows (M, K) W_i^T for up to MAX_WEIGHTS weights (N_i, K) into y, M x (sum of
    widths) contiguous elements: the products (M, N_i) one after another, each row-major; with `split` > 1 the
    float32 partial products over `split` equal parts of K, y (split, M x sum of widths). `step` divides K (or its
    parts). The block sizes are the caller's (`benchmarks/projection_bench.py --sweep` tries others).
    With `out` (y's layout, the output dtype) and `tickets` (int32 zeros, a row block's each: `_triton.tickets_of`),
    the same launch writes the partials' sum into out, + `residual` (M, N) where given, with RoPE on the first two
    weights' heads where `rope` = (cos, sin, L, head_dim) (block_n a multiple of head_dim), and the second and third
    weights' sums (k, v) stored into `cache` = (keys, values, length) of a StaticCache layer at its positions
    length + l of each token (b, l) (the length not advanced; rows of the batch's B x L tokens, L as `rope`'s)."""
    if (out is None) != (tickets is None):
        raise ValueError("launch_projections: `out` and `tickets` go together (the sum needs a ticket a row block)")
    if cache is not None and (out is None or rope is None):
        raise ValueError("launch_projections: `cache` takes the summed, rotated k and v (`out` and `rope`)")
    m, k = rows.shape
    widths = [w.shape[0] for w in weights]
    pad = MAX_WEIGHTS - len(weights)
    cos, sin, length, head_dim = rope if rope is not None else (y, y, 1, 0)
    strides = (cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1)) if rope is not None else (0, 0)
    keys, values, cache_length = cache if cache is not None else (y, y, y)
    cache_args = (
        (keys, values, cache_length, keys.shape[2], *keys.stride()[:3], *values.stride()[:3], keys.shape[-1],
         values.shape[-1]) if cache is not None else (y, y, y, 0, 0, 0, 0, 0, 0, 0, 1, 1)
    )
    pdl = dependent_launch(rows, m)
    try:
        _projections[(sum(cdiv(n, block_n) for n in widths), split)](
            rows, *weights, *weights[:1] * pad, y, m, *widths, *(0,) * pad,
            y if out is None else out, y if residual is None else residual, cos, sin,
            y if tickets is None else tickets, length, *strides, *cache_args, K=k, SPLIT=split,
            SUMMED=out is not None, ADD=residual is not None, HALF=head_dim // 2, CACHED=cache is not None,
            BLOCK_M=max(16, next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=step, PDL=pdl, num_stages=stages,
            num_warps=warps, launch_pdl=pdl,
        )
    except BaseException:  # a launch cut short (the interpreter's programs run one by one) leaves no ticket taken
        if tickets is not None:
            tickets.zero_()
        raise


def launch_gated_projection(rows, w_gate, w_up, y, block_n: int, step: int, stages: int, warps: int = 4) -> None:
    """One `_gated_projection` launch: y (M, I) = silu(rows W_gate^T) * (rows W_up^T), rows (M, K) contiguous."""
    m, k = rows.shape
    pdl = dependent_launch(rows, m)
    _gated_projection[(cdiv(w_gate.shape[0], block_n),)](
        rows, w_gate, w_up, y, m, w_gate.shape[0], K=k, BLOCK_M=max(16, next_power_of_2(m)), BLOCK_N=block_n,
        BLOCK_K=step, PDL=pdl, num_stages=stages, num_warps=warps, launch_pdl=pdl,
    )


SPLIT_MAX_TOKENS = 16
# Tokens of a step whose q, k and v `rotated_projections` takes (split, summed, rotated and stored into a StaticCache
# layer in one launch), apart from o_proj's and down_proj's split: at 32 tokens this launch took the batch-32 steps of
# V1 and DEX at a 2K context from 1.796 to 1.782 and from 1.708 to 1.696 ms on the H200 (V2's 1.751 -> 1.755), where
# the split o_proj and down_proj made every mode's slower (1.838, 1.792, 1.753; benchmarks/decode_variants.py
# --constants).
ROTATED_MAX_TOKENS = 32
SMALLEST_BLOCK_N = 16  # rows a program of the split products, at the least


def row_block_tickets(weights, block_n: int) -> torch.Tensor:
    """The tickets of a split launch over `weights` (one per row block of block_n rows), owned by the first weight
    and sized for the smallest blocks, so that other block sizes (benchmarks/decode_variants.py --split) fit."""
    if block_n < SMALLEST_BLOCK_N:
        raise ValueError(f"block_n: the split products take blocks of at least {SMALLEST_BLOCK_N} rows, got {block_n}")
    return tickets_of(weights[0], sum(cdiv(w.shape[0], SMALLEST_BLOCK_N) for w in weights), weights[0].device)


def launch_split_linear(rows, weight, y, residual, block_n: int, step: int, split: int, stages: int,
                        warps: int = 4) -> None:
    """One launch: y (M, N) = rows (M, K) weight^T as `split` float32 partial products over equal parts of K (each
    a multiple of `step`), and their sum rounded to y's dtype, plus `residual` (M, N) where it is given, by the last
    of each row block's programs."""
    m = rows.shape[0]
    n = weight.shape[0]
    parts = torch.empty(split, m, n, dtype=torch.float32, device=rows.device)
    launch_projections(rows, [weight], parts, block_n, step, stages, warps, split, out=y,
                       tickets=row_block_tickets([weight], block_n), residual=residual)


def linear_maps(x: torch.Tensor, *linears: nn.Linear, fused: bool) -> tuple[torch.Tensor, ...]:
    """(layer(x) for each of `linears`): with `fused` (the caller is on a fast implementation), the products of two or
    more plain layers in one launch (per MAX_WEIGHTS) where the kernel takes x, a plain layer alone split along K
    (`split_linear`), and in training plain layers as one autograd node (`shared_input_linears`); every other layer
    through its own forward.
    The kernel's outputs are contiguous blocks of one buffer (decoding steps are bound by host work: one
    allocation, one split), viewed with x's leading dims."""
    if not (fused and few_rows_apply(x)):
        if fused and shared_input_linears_apply(x, linears):  # training: one node, x's gradients summed by cuBLAS
            return shared_input_linears(x, linears)
        return tuple(layer(x) for layer in linears)
    read = [layer for layer in linears if kernel_reads(layer, x)]
    if len(read) == 1 and len(linears) == 1 and split_linear_applies(x, read[0]):  # a weight alone: split along K
        return (split_linear(x, read[0]),)
    if len(read) < 2:
        return tuple(layer(x) for layer in linears)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    block_m = max(16, next_power_of_2(rows.shape[0]))  # x's rows padded for the tensor cores
    products = []
    for start in range(0, len(read), MAX_WEIGHTS):
        weights = [layer._parameters["weight"] for layer in read[start:start + MAX_WEIGHTS]]
        widths = [w.shape[0] for w in weights]
        y = torch.empty(rows.shape[0] * sum(widths), dtype=x.dtype, device=x.device)
        block_n = 32 if sum(widths) <= 4096 else 64  # fewer, fuller programs measured faster than one per SM
        step = block_k(rows.shape[1], block_n)
        launch_projections(rows, weights, y, block_n, step, pipeline_stages(block_m, block_n, step, x))
        blocks = y.split([rows.shape[0] * n for n in widths])
        products += (block.view(*x.shape[:-1], n) for block, n in zip(blocks, widths))
    if len(read) == len(linears):
        return tuple(products)
    computed = {id(layer): y for layer, y in zip(read, products)}
    return tuple(computed[id(layer)] if id(layer) in computed else layer(x) for layer in linears)


def rotated_projections_apply(x: torch.Tensor, linears, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> bool:
    """Whether `rotated_projections` takes x: steps of at most ROTATED_MAX_TOKENS tokens, two to MAX_WEIGHTS plain
    layers, q's and k's widths whole heads, whole heads in a row block (`rotated_split`), cos and
    sin (B or 1, L, head_dim) of x's dtype."""
    return (
        few_rows_apply(x) and x.dim() == 3 and x.numel() <= ROTATED_MAX_TOKENS * x.shape[-1]
        and 2 <= len(linears) <= MAX_WEIGHTS and all(kernel_reads(layer, x) for layer in linears)
        and linears[0].out_features % head_dim == 0 and linears[1].out_features % head_dim == 0 and head_dim % 2 == 0
        and rotated_split(x.shape[-1], x.shape[0] * x.shape[1], [layer.out_features for layer in linears],
                          head_dim, x.device)[0] % head_dim == 0
        and cos.shape == sin.shape and cos.dim() == 3 and cos.shape[0] in (1, x.shape[0])
        and cos.shape[1:] == (x.shape[1], head_dim) and cos.dtype == sin.dtype == x.dtype
        and cos.stride(-1) == sin.stride(-1) == 1 and cos.stride() == sin.stride()
        and not (cos.requires_grad or sin.requires_grad)
    )


def rotated_split(width: int, tokens: int, widths, head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """(rows a program, its K step, parts of K) of `rotated_projections` over weights of `widths` rows: the split's
    (`split_config`), with ROTATED_SPLIT_MANY_PROGRAMS's where that split's programs at up to FEW_TOKENS tokens would
    take more than one wave of FEW_TOKENS_PROGRAMS_PER_SM a multiprocessor; at least a head's rows (the sum rotates
    whole heads; a head_dim that is not a power of two may not fit)."""
    head_rows = next_power_of_2(head_dim)
    block_n, step, split = split_config(width, tokens)
    block_n = max(block_n, head_rows)
    programs = sum(cdiv(n, block_n) for n in widths) * split
    if tokens <= FEW_TOKENS and programs > FEW_TOKENS_PROGRAMS_PER_SM * sm_count(device):
        block_n, step, split = split_config(width, tokens, ROTATED_SPLIT_MANY_PROGRAMS)
        block_n = max(block_n, head_rows)
    return block_n, step, split


def rotated_projections(x: torch.Tensor, linears, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                        cache=None) -> tuple[torch.Tensor, ...]:
    """(layer(x) for each of `linears`) with RoPE (`rope.py`'s formula) on every head_dim-wide head of the first two
    (q and k), in one launch: the products split along K (`rotated_split`: o_proj's measured split in steps of at
    most FEW_TOKENS tokens, SPLIT_MORE_TOKENS above), and the last program of each row block sums its parts, rounds
    them as F.linear does and rotates q's and k's heads, where `linear_maps` and `apply_rope` take three launches.
    Check `rotated_projections_apply` first.
    x (B, L, K); cos, sin (B or 1, L, head_dim) -> each (B, L, N_i), contiguous blocks of one buffer. With `cache` =
    (keys, values, length) of a StaticCache layer (`cache_write.projection_cache_layer`), the same launch also stores
    k and v into it at its next positions, the length not advanced."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    m = rows.shape[0]
    weights = [layer._parameters["weight"] for layer in linears]
    widths = [w.shape[0] for w in weights]
    block_n, step, split = rotated_split(rows.shape[1], m, widths, head_dim, x.device)
    parts = torch.empty(split, m * sum(widths), dtype=torch.float32, device=x.device)
    y = torch.empty(m * sum(widths), dtype=x.dtype, device=x.device)
    if m > 0:
        stages = pipeline_stages(max(16, next_power_of_2(m)), block_n, step, x)
        launch_projections(rows, weights, parts, block_n, step, stages, split=split, out=y,
                           tickets=row_block_tickets(weights, block_n), rope=(cos, sin, x.shape[1], head_dim),
                           cache=cache)
    blocks = y.split([m * n for n in widths])
    return tuple(block.view(*x.shape[:-1], n) for block, n in zip(blocks, widths))


# Steps of at most FEW_TOKENS tokens take the *_FEW_TOKENS launch configurations, longer ones *_MORE_TOKENS
FEW_TOKENS = 16
# (rows a program, most K step, most parts of K) of the split products (`benchmarks/decode_variants.py --split`
# times others in the step). Above FEW_TOKENS only q, k and v are split (`ROTATED_MAX_TOKENS`): at batch 32 and a 2K
# context two parts of eight pipelined 128-wide steps took the H200's step from 1.783 to 1.758 ms (V1), 1.758 to
# 1.710 (V2) and 1.694 to 1.673 (DEX), where four parts of one 512-wide step had been the launch of every step
# (`--constants 'projection.SPLIT_MORE_TOKENS=(64,128,2)'`; (64,128,4) and (64,64,4) were 0.005-0.013 ms slower).
SPLIT_FEW_TOKENS = (64, 512, 8)
SPLIT_MORE_TOKENS = (64, 128, 2)
# q, k and v's split (`rotated_split`) up to FEW_TOKENS tokens where SPLIT_FEW_TOKENS's would take more than one wave:
# at one token, K 2048, SPLIT_FEW_TOKENS's (64, 512, 4) compiles for sm_90a to 174 registers a thread, so 2 programs
# fit on a multiprocessor (FEW_TOKENS_PROGRAMS_PER_SM), and V2's q, k, v and lambda_proj are 324 programs, 1.23 waves
# of the H200's 264; (64, 256, 4) takes 140, so 3 fit and the 324 run in one wave. The H200's batch-1 step of V2 went
# from 0.982 to 0.943 ms at an 8K context and from 0.888 to 0.872 at 2K, where V1's (256 programs) and DEX's (192),
# one wave either way, were 0.03-0.07 ms slower with it (each part's second step is read after PDL's wait for x)
# (benchmarks/decode_variants.py --constants, benchmarks/RESULTS.md).
ROTATED_SPLIT_MANY_PROGRAMS = (64, 256, 4)
FEW_TOKENS_PROGRAMS_PER_SM = 2


def split_config(width: int, tokens: int, few_tokens: tuple | None = None) -> tuple[int, int, int]:
    """(rows a program, its K step, parts of K) of `launch_split_linear` for a step of `tokens` tokens: up to
    FEW_TOKENS `few_tokens` where given, else SPLIT_FEW_TOKENS, what measured fastest on the H200 for o_proj and
    down_proj at one token (benchmarks/pdl_bench.py: 64 rows, 512-wide steps and parts of 1-2 steps, 4 parts of
    o_proj's 2048, 8 of down_proj's 8192); SPLIT_MORE_TOKENS above (see there); each part a whole number of steps
    (the loop has no mask)."""
    block_n, most_step, most_parts = (few_tokens or SPLIT_FEW_TOKENS) if tokens <= FEW_TOKENS else SPLIT_MORE_TOKENS
    step = min(most_step, width & -width)
    steps = width // step
    return block_n, step, min(most_parts, steps & -steps)  # a power of two dividing the steps


def split_linear_applies(x: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None = None) -> bool:
    """Whether `split_linear` takes x: steps of at most SPLIT_MAX_TOKENS tokens (at 32 the split products and their
    sum measured slower than cuBLAS in the H200's step, benchmarks/decode_variants.py), a plain layer, a residual of
    the output's shape and x's dtype."""
    return (
        few_rows_apply(x) and x.numel() <= SPLIT_MAX_TOKENS * x.shape[-1] and kernel_reads(linear, x)
        and (residual is None or (
            type(residual) is torch.Tensor and residual.dtype == x.dtype and residual.is_contiguous()
            and residual.shape == (*x.shape[:-1], linear.out_features)
        ))
    )


def split_linear(x: torch.Tensor, linear: nn.Linear, residual: torch.Tensor | None = None) -> torch.Tensor:
    """linear(x), or residual + linear(x) rounded as that sum is, through the split products and their sum (check
    `split_linear_applies` first)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    weight = linear._parameters["weight"]
    y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return y
    block_n, step, split = split_config(rows.shape[1], rows.shape[0])
    stages = pipeline_stages(max(16, next_power_of_2(rows.shape[0])), block_n, step, x)
    launch_split_linear(rows, weight, y, residual, block_n, step, split, stages)
    return y


# (rows a program, K step, warps, most pipeline stages) of `gated_projection`: steps of at most FEW_TOKENS tokens and
# more (`benchmarks/decode_variants.py --gated` times others in the step)
GATED_FEW_TOKENS = (32, 256, 4, 3)
GATED_MORE_TOKENS = (64, 128, 4, 4)


def gated_projection_applies(x: torch.Tensor, gate: nn.Module, up: nn.Module) -> bool:
    return (
        few_rows_apply(x) and kernel_reads(gate, x) and kernel_reads(up, x)
        and gate._parameters["weight"].shape == up._parameters["weight"].shape
    )


def gated_projection(x: torch.Tensor, gate: nn.Linear, up: nn.Linear) -> torch.Tensor:
    """silu(gate(x)) * up(x) in one launch (check `gated_projection_applies` first), LlamaMLP's activation with its
    rounding: gate(x), up(x), silu and the product each rounded to the dtype."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
    m, k = rows.shape
    w_gate, w_up = gate._parameters["weight"], up._parameters["weight"]  # (I, K) each
    y = torch.empty(m, w_gate.shape[0], dtype=x.dtype, device=x.device)
    block_m = max(16, next_power_of_2(m))
    block_n, step, warps, most_stages = GATED_FEW_TOKENS if m <= FEW_TOKENS else GATED_MORE_TOKENS
    step = min(step, k & -k)
    stages = pipeline_stages(block_m, 2 * block_n, step, x, most_stages)
    launch_gated_projection(rows, w_gate, w_up, y, block_n, step, stages, warps)
    return y.view(*x.shape[:-1], w_gate.shape[0])
