"""Triton split-KV attention for decoding steps (few query tokens): each KV-cache entry is read once per step.

A program owns one (batch, kv head) and one chunk of the cached sequence. Its rows are every query of the
kv head's GQA group (G query heads x L tokens), so the K and V tiles it loads serve the whole group; the
chunks run in parallel (flash-decoding) and a reduce kernel merges their partial softmaxes. The reduce runs a
program per query row (per head pair for V1 and V2) and reads all of the row's chunks in one load: a decoding
step waits on its latency, not on its few bytes. For the differential modes the reduce also applies the mode's
differential term (`_decode_reduce_combined`: V1's and V2's combine of each head pair, DEX's operator), and V1's
queries are read as they come (`PAIRED`: Q1 against K1, Q2 against K2 of the 2d-wide cached key). The chunks are
at most as many as fit on the GPU at once (one wave), and where the launch before stored the step's keys and values
into a StaticCache layer, a program reads its chunk's first keys before it waits for that launch (PDL), the step's
own positions after.

Imported only when triton is installed (see `kernels/decode.py` for the reference and the dispatch).
"""

import functools

import torch
from torch.library import triton_op, wrap_triton

from . import _triton  # DECODE_PDL_MAX_TOKENS read where used: one value for these kernels, set in one place
from ._triton import (
    TRITON_INTERPRETING, cdiv, dependent_launch, dot_precision, next_power_of_2, shared_memory, sm_count,
)
from .masks import causal_offset, kernel_mask
from .triton_combine import anneal_fraction, dex_lambda, differential_lambda, v1_combine_rows

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error

from .triton_launch import let_dependents_start, wait_for_inputs


# The split-KV kernel's launch parameters, in one place for tuning on the GPU; `_partial_softmaxes` passes them.
PARTIAL_BLOCK_N = 64  # keys per tile; a power of two >= 16 (tl.dot's smallest), and the shortest chunk
# Keys per tile in steps of at most DECODE_PDL_MAX_TOKENS tokens whose values are at least WIDE_VALUES wide (V1's
# 2d): on the H200 128 took V1's batch-1 step at a 2K context from 0.885 to 0.856 ms (half the chunks for the reduce
# to merge), where V2's (64-wide values) went from 0.929 to 0.973 ms (benchmarks/decode_variants.py --partial).
PARTIAL_BLOCK_N_WIDE_FEW_TOKENS = 128
WIDE_VALUES = 128
PARTIAL_NUM_WARPS = 4
PARTIAL_NUM_STAGES = 3  # Triton's default
# Steps of at most DECODE_PDL_MAX_TOKENS tokens: 4 stages took 0.02 ms off V1's and V2's batch-1 steps on the H200
# (DEX's changed by less than its spread); at batch 32 they made V1's 0.27 ms slower (benchmarks/decode_variants.py
# --partial).
PARTIAL_NUM_STAGES_FEW_TOKENS = 4
# ... and 3 where the tiles are PARTIAL_BLOCK_N_WIDE_FEW_TOKENS keys of values at least WIDE_VALUES wide (V1's 2d): on
# the H200 V1's batch-1 step took 0.915 against 0.927 ms at an 8K context and 0.839 against 0.842 at 2K (one program a
# multiprocessor either way; benchmarks/decode_variants.py --constants, benchmarks/RESULTS.md).
PARTIAL_NUM_STAGES_WIDE_FEW_TOKENS = 3
# The number of chunks (splits) aims at about this many programs per multiprocessor. In steps of at most
# DECODE_PDL_MAX_TOKENS tokens 3: on the H200 a batch-1 step at a 2K context took DEX from 0.897 to 0.848 ms and V2
# from 0.944 to 0.934 (V1's 4 kv heads keep their chunks: at most one per 64-key tile); at batch 32, 3 made V1's step
# 1.81 -> 1.99 ms (benchmarks/decode_variants.py --partial).
PROGRAMS_PER_SM = 2
PROGRAMS_PER_SM_FEW_TOKENS = 3
# The read before the wait (`_decode_partial`'s FIRST_N) takes the most keys, a power of two and at least a tile, whose
# keys and values are at most this many bytes: they sit in registers across the wait (32 KiB is 64 a thread at 4
# warps).
PREFETCH_MAX_BYTES = 32 * 1024
# Warps of a reduce program (Triton's default). Compiled for sm_90a (`benchmarks/kernel_registers.py`), V1's reduce
# takes 15 block-wide barriers at 4 warps and none at 1 (its reductions become warp shuffles), DEX's 6 and 1. On the
# H200 (batch 1, benchmarks/decode_variants.py --constants) 1 warp took V1's step from 0.856 to 0.924 ms at a 2K
# context and from 0.939 to 2.201 at 8K (a warp holds every chunk's (DV,) output), and 2 warps changed no step by
# more than 0.003 ms: with 18-33 chunks a row the barriers are not what the reduce waits on.
REDUCE_NUM_WARPS = 4
# Warps of a differential mode's reduce program where it merges at most REDUCE_FEW_SPLITS chunks a row (batch 32 has
# 2-3): on the H200 1 warp took V1's batch-32 step at a 2K context from 1.756 to 1.708 ms (V2 1.707 -> 1.701, DEX
# 1.671 -> 1.672; 2 warps: 1.731 / 1.708 / 1.669; benchmarks/decode_variants.py --constants, before this rule, at
# 4.13 TB/s). The plain reduce (`_decode_reduce`) was not measured with it and keeps REDUCE_NUM_WARPS.
REDUCE_FEW_SPLITS = 4
REDUCE_NUM_WARPS_FEW_SPLITS = 1


@triton.jit
def _attend_tile(q, K, V, Mask, b, kvh, t, row_ok, dk, dv, n, end, k, v, skb, skh, sks, svb, svh, svs, smb, sml, sms,
                 offset, qk_scale, m_i, l_i, acc, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys n (N,), those below `end`, into the online softmax (m_i, l_i, acc) of the rows; k (DK, N) and
    v (N, DV) as loaded, or None to load them here."""
    n_ok = n < end
    if k is None:
        k = tl.load(K + b * skb + kvh * skh + n[None, :] * sks + dk[:, None], mask=n_ok[None, :], other=0.0)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # (BLOCK_R, BLOCK_N), fp32
    if HAS_MASK:
        allowed = tl.load(
            Mask + b * smb + t[:, None] * sml + n[None, :] * sms, mask=row_ok[:, None] & n_ok[None, :], other=0
        ) != 0
    else:  # causal (kernels/masks.py)
        allowed = n[None, :] <= (offset + t)[:, None]
    allowed = allowed & n_ok[None, :]
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    if v is None:
        v = tl.load(V + b * svb + kvh * svh + n[:, None] * svs + dv[None, :], mask=n_ok[:, None], other=0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


# The cache length (and with it the causal offset, the mask's strides, the chunk length and the number of chunks)
# grows every step: not specialized on (Triton would compile a variant whenever one crosses a multiple of 16), so
# one compiled kernel serves a whole generation.
@triton.jit(do_not_specialize=["smb", "sml", "S", "offset", "chunk", "splits", "parts"])
def _decode_partial(
    Q, K, V, Mask, Part, Written,
    sqb, sqh, sql, skb, skh, sks, svb, svh, svs, smb, sml, sms,
    H_KV, S, L, offset, chunk, splits, parts,
    SCALE: tl.constexpr,  # a compile-time constant: a runtime float would reach Inductor's launch as fp64
    G: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, PAIRED: tl.constexpr,
    FIRST_N: tl.constexpr, PDL: tl.constexpr, PRECISION: tl.constexpr,  # tl.dot's (`_triton.dot_precision`)
):
    # FIRST_N > 0: the step's keys and values are at the positions Written.. (a StaticCache layer's length, int64,
    # that the projections' launch, the kernel before, did not advance: `cache_write.py`). The chunk's first FIRST_N
    # keys (a multiple of BLOCK_N) are one tile whose positions written in earlier steps are read before the wait, so
    # that their latency overlaps the kernel before; its new positions after it.
    let_dependents_start(PDL)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    start = split * chunk  # chunk: a multiple of BLOCK_N
    if FIRST_N > 0:
        n = start + tl.arange(0, FIRST_N)
        written = tl.load(Written)
        end = tl.minimum(S, start + chunk)  # FIRST_N may pass a short chunk
        earlier = (n < written) & (n < end)
        k = tl.load(K + b * skb + kvh * skh + n[None, :] * sks + dk[:, None], mask=earlier[None, :], other=0.0)
        v = tl.load(V + b * svb + kvh * svh + n[:, None] * svs + dv[None, :], mask=earlier[:, None], other=0.0)
    wait_for_inputs(PDL)  # the query, and the cache's new entries, are the kernel before's
    r = tl.arange(0, BLOCK_R)
    g = r // L  # query head within the group
    t = r % L  # query token
    row_ok = r < G * L
    # PAIRED (V1, DK = 2 DQ): query head 2i + m holds Q_m (DQ wide) of differential head i and is read into
    # columns m DQ.. of a zero row, so its dot with the cached K1|K2 is Q_m . K_m. Otherwise DK = DQ.
    column = dk[None, :] - ((kvh * G + g) % 2 * DQ)[:, None] if PAIRED else dk[None, :]
    q = tl.load(
        Q + b * sqb + (kvh * G + g)[:, None] * sqh + t[:, None] * sql + column,
        mask=row_ok[:, None] & (column >= 0) & (column < DQ), other=0.0,
    )
    qk_scale = SCALE * 1.4426950408889634  # softmax in base 2

    # A finite "minus infinity": a chunk whose keys are all masked stays NaN-free.
    m_i = tl.full((BLOCK_R,), -1.0e30, tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, DV), tl.float32)
    if FIRST_N > 0:
        new = (n >= written) & (n < end)
        k = tl.where(new[None, :], tl.load(K + b * skb + kvh * skh + n[None, :] * sks + dk[:, None],
                                           mask=new[None, :], other=0.0), k)
        v = tl.where(new[:, None], tl.load(V + b * svb + kvh * svh + n[:, None] * svs + dv[None, :],
                                           mask=new[:, None], other=0.0), v)
        m_i, l_i, acc = _attend_tile(q, K, V, Mask, b, kvh, t, row_ok, dk, dv, n, end, k, v, skb, skh, sks, svb,
                                     svh, svs, smb, sml, sms, offset, qk_scale, m_i, l_i, acc, HAS_MASK, PRECISION)
    for n0 in range(FIRST_N, chunk, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, K, V, Mask, b, kvh, t, row_ok, dk, dv, start + n0 + tl.arange(0, BLOCK_N), S,
                                     None, None, skb, skh, sks, svb, svh, svs, smb, sml, sms, offset, qk_scale,
                                     m_i, l_i, acc, HAS_MASK, PRECISION)

    part = pid_bh * splits + split
    tl.store(Part + (part * BLOCK_R + r)[:, None] * DV + dv[None, :], acc)
    tl.store(Part + parts * DV + part * BLOCK_R + r, m_i)
    tl.store(Part + parts * (DV + 1) + part * BLOCK_R + r, l_i)


@triton.jit
def _merge_splits(Part, parts, first_part, row, splits,
                  BLOCK_R: tl.constexpr, DV: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """The attention output (DV,) fp32 of one query row: the chunks' partial softmaxes merged. Part holds the
    `parts` rows of partial outputs (DV each), then their maxima, then their sums; the row's `splits` chunks are
    the parts first_part.. . Every chunk's max, sum and output are read in one (MAX_SPLITS, DV) load (a loop over
    the chunks would wait on one memory round trip per chunk) and merged with reductions over the chunk axis."""
    split = tl.arange(0, MAX_SPLITS)  # MAX_SPLITS: splits rounded up to a power of two
    live = split < splits
    index = (first_part + split) * BLOCK_R + row  # (MAX_SPLITS,)
    dv = tl.arange(0, DV)
    # A dead chunk reads as the partial kernel's empty chunk: the finite "minus infinity", sum 0, output 0.
    m_s = tl.load(Part + parts * DV + index, mask=live, other=-1.0e30)
    l_s = tl.load(Part + parts * (DV + 1) + index, mask=live, other=0.0)
    o_s = tl.load(Part + index[:, None] * DV + dv[None, :], mask=live[:, None], other=0.0)
    beta = tl.exp2(m_s - tl.max(m_s, axis=0))  # softmax in base 2, as the partial kernel's
    l_sum = tl.sum(l_s * beta, axis=0)
    acc = tl.sum(o_s * beta[:, None], axis=0)
    return acc / tl.where(l_sum > 0, l_sum, 1.0)  # a query with no visible key gets 0


# The reduces run one program per query row (per head pair for V1, V2) of each (batch, kv head): a decoding
# step has few rows, and each program's latency, not its work, is what the step waits on.
@triton.jit(do_not_specialize=["splits", "parts"])
def _decode_reduce(
    Part, Out, sob, sol, soh, H_KV, L, splits, parts,
    G: tl.constexpr, BLOCK_R: tl.constexpr, DV: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    row = tl.program_id(1)  # the group's row g * L + t is query head g, token t
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    out = _merge_splits(Part, parts, pid_bh * splits, row, splits, BLOCK_R, DV, MAX_SPLITS)
    dv = tl.arange(0, DV)
    tl.store(Out + b * sob + (row % L) * sol + (kvh * G + row // L) * soh + dv, out.to(Out.dtype.element_ty))


@triton.jit(do_not_specialize=["splits", "parts"])
def _decode_reduce_combined(
    Part, Out, sob, sol, soh, H_KV, L, splits, parts,
    Logits, szb, szl, szh, NormW, eps, norm_scale, LambdaQ1, LambdaK1, LambdaQ2, LambdaK2,
    Operator, HeadMask, LambdaLearn, AnnealStep, anneal_steps, lambda_init, Length,
    G: tl.constexpr, BLOCK_R: tl.constexpr, DV: tl.constexpr, MAX_SPLITS: tl.constexpr,
    MODE: tl.constexpr, ANNEALED: tl.constexpr, D_LAMBDA: tl.constexpr, ADVANCE: tl.constexpr, PDL: tl.constexpr,
):
    """The merge, then each mode's differential term on the merged head outputs (`decode.py`):
    MODE 0 (V1) pairs of query heads (2i, 2i+1) -> norm_scale * subln(O1 - lambda O2), lambda from its vectors;
    MODE 1 (V2) pairs -> O1 - sigmoid(z) min(1, t/T) O2, z = Logits (B, L, h);
    MODE 2 (DEX) each head -> O - lambda(t) mask_h O W^T, W = Operator (DV, DV).
    A program per query row (DEX) or per pair (V1, V2: subln needs both maps of the pair).
    ADVANCE: the projections stored the step's keys and values into a StaticCache layer (`cache_write.py`); the
    first program advances its length (int64) by L, after the wait: every kernel that read it has finished."""
    let_dependents_start(PDL)
    wait_for_inputs(PDL)
    pid_bh = tl.program_id(0)
    if ADVANCE:
        if (pid_bh == 0) & (tl.program_id(1) == 0):
            tl.store(Length, tl.load(Length) + L)
    b = pid_bh // H_KV
    kvh = pid_bh % H_KV
    first_part = pid_bh * splits
    dv = tl.arange(0, DV)
    if MODE == 2:
        row = tl.program_id(1)  # the group's row g * L + t is query head g, token t
        t = row % L
        head = kvh * G + row // L
        o = _merge_splits(Part, parts, first_part, row, splits, BLOCK_R, DV, MAX_SPLITS)
        lam = dex_lambda(LambdaLearn, anneal_fraction(AnnealStep, anneal_steps, ANNEALED), lambda_init)
        lam_h = lam * tl.load(HeadMask + head).to(tl.float32)
        w = tl.load(Operator + dv[:, None] * DV + dv[None, :]).to(tl.float32)  # (DV, DV): W[j, k]
        out = o - lam_h * tl.sum(w * o[None, :], axis=1)  # (O W^T)_j = sum_k W[j, k] O_k
    else:
        pair = tl.program_id(1)  # (pair i, token t); the pair's rows are 2i * L + t and (2i + 1) * L + t
        i = pair // L
        t = pair % L
        first = 2 * i * L + t
        o1 = _merge_splits(Part, parts, first_part, first, splits, BLOCK_R, DV, MAX_SPLITS)
        o2 = _merge_splits(Part, parts, first_part, first + L, splits, BLOCK_R, DV, MAX_SPLITS)
        head = kvh * (G // 2) + i
        if MODE == 0:
            lam = differential_lambda(LambdaQ1, LambdaK1, LambdaQ2, LambdaK2, lambda_init, D_LAMBDA)
            y, _ = v1_combine_rows(o1[None, :], o2[None, :], lam, tl.load(NormW + dv).to(tl.float32), eps,
                                   norm_scale, DV)
            out = tl.reshape(y, (DV,))
        else:
            z = tl.load(Logits + b * szb + t * szl + head * szh).to(tl.float32)
            fraction = tl.minimum(anneal_fraction(AnnealStep, anneal_steps, ANNEALED), 1.0)
            out = o1 - tl.sigmoid(z) * fraction * o2
    tl.store(Out + b * sob + t * sol + head * soh + dv, out.to(Out.dtype.element_ty))


def _traceable(kernel):
    return kernel if TRITON_INTERPRETING else wrap_triton(kernel)


def _plain(kernel):
    return kernel


def partial_shared_memory(block_rows: int, block_n: int, stages: int, k_dim: int, v_dim: int,
                          element_size: int, masked: bool = False) -> int:
    """Bytes of shared memory a program of the split-KV kernel takes, at most: what Triton 3.6 allocates, compiled for
    sm_90a (`benchmarks/kernel_registers.py`'s compile): stages - 1 buffers of the K and V tiles (and, `masked`,
    of the bool mask's) below 64 rows, one for every stage at 64 (its wgmma pipeline), and up to twice the query
    tile."""
    buffers = stages if block_rows >= 64 else stages - 1
    tile = block_n * (k_dim + v_dim) * element_size + (block_rows * block_n if masked else 0)
    return buffers * tile + 2 * block_rows * k_dim * element_size


def partial_tiles(tokens: int, block_rows: int, k_dim: int, v_dim: int, element_size: int, device: torch.device,
                  masked: bool = False) -> tuple[int, int]:
    """(keys per tile, pipeline stages) of the split-KV kernel in a step of `tokens` tokens, `block_rows` query rows
    a program (`masked`: reading a bool mask): the constants above, with fewer keys (down to PARTIAL_BLOCK_N) and then
    fewer stages where a program would take more than 90% of the device's shared memory (`partial_shared_memory`)."""
    few = tokens <= _triton.DECODE_PDL_MAX_TOKENS
    wide = few and v_dim >= WIDE_VALUES
    block_n = PARTIAL_BLOCK_N_WIDE_FEW_TOKENS if wide else PARTIAL_BLOCK_N
    stages = PARTIAL_NUM_STAGES_WIDE_FEW_TOKENS if wide else PARTIAL_NUM_STAGES_FEW_TOKENS if few else PARTIAL_NUM_STAGES
    room = int(0.9 * shared_memory(device))

    def fits() -> bool:
        return partial_shared_memory(block_rows, block_n, stages, k_dim, v_dim, element_size, masked) <= room

    while block_n > PARTIAL_BLOCK_N and not fits():
        block_n //= 2
    while stages > 2 and not fits():
        stages -= 1
    return block_n, stages


@functools.cache
def _sm_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory of one multiprocessor, for all its resident programs."""
    if device.type != "cuda":
        return _triton.INTERPRETER_SM_SHARED_MEMORY
    return torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor


def programs_per_sm(tokens: int, program_bytes: int, device: torch.device) -> int:
    """The programs per multiprocessor the chunks aim at in a step of `tokens` tokens (see PROGRAMS_PER_SM), at most
    as many as fit at once in its shared memory (`program_bytes` each, and the 1 KiB the GPU reserves for each):
    more chunks than fit would run in a second wave, as V1's 128-key programs at an 8K context did (one fits)."""
    aim = PROGRAMS_PER_SM_FEW_TOKENS if tokens <= _triton.DECODE_PDL_MAX_TOKENS else PROGRAMS_PER_SM
    return max(1, min(aim, _sm_shared_memory(device) // (program_bytes + 1024)))


def prefetched_keys(chunk: int, block_n: int, key_bytes: int) -> int:
    """Keys of a chunk read before the kernel's wait, where the projections stored the step's keys (`FIRST_N`; 0: none):
    the most, a power of two of at least a tile, whose keys and values (`key_bytes` a key) fit PREFETCH_MAX_BYTES,
    and no more than the chunk's length rounded up to a power of two. Only under PDL does that read overlap the
    kernel before; the interpreter (no PDL) takes the same path, so that CI runs what the GPU does."""
    most = PREFETCH_MAX_BYTES // key_bytes
    if most < block_n:
        return 0
    return min(1 << (most.bit_length() - 1), next_power_of_2(chunk))


def _partial_softmaxes(query, key, value, mask, scale: float, launcher, written=None):
    """Launch the split-KV kernel; -> (workspace of the partial softmaxes, splits, parts, rows per program).
    query (B, Hq, L, DQ) any strides; with key (B, H_KV, S, 2 DQ) its heads are read PAIRED (V1). `written`: the
    StaticCache layer's length before the step, where the kernel before stored the step's keys and values at it
    (the kernel's FIRST_N).
    Host arithmetic in plain ints: a decoding step is bound by its host work, and triton.cdiv & co. are
    constexpr functions that cost microseconds per call from Python."""
    batch, q_heads, length, q_dim = query.shape
    _, kv_heads, kv_length, k_dim = key.shape
    v_dim = value.shape[-1]
    groups = q_heads // kv_heads
    block_rows = max(16, next_power_of_2(groups * length))
    element = key.element_size()
    masked = mask is not None
    block_n, stages = partial_tiles(batch * length, block_rows, k_dim, v_dim, element, query.device, masked)
    program_bytes = partial_shared_memory(block_rows, block_n, stages, k_dim, v_dim, element, masked)
    # Enough chunks of equal length (a multiple of the tile) for about PROGRAMS_PER_SM programs per multiprocessor.
    # Not a power of two: a cache just past one (a StaticCache of 2048 + the new tokens) would get a full chunk
    # and a nearly empty one, half the programs, and half the memory traffic in flight (measured on the H200).
    per_sm = programs_per_sm(batch * length, program_bytes, query.device)
    target = max(1, cdiv(per_sm * sm_count(query.device), batch * kv_heads))
    chunk = cdiv(cdiv(kv_length, target), block_n) * block_n
    splits = cdiv(kv_length, chunk)
    parts = batch * kv_heads * splits * block_rows
    work = torch.empty(parts * (v_dim + 2), dtype=torch.float32, device=query.device)  # outputs, maxima, sums
    mask_arg, mask_strides = kernel_mask(mask, query)
    # not through torch.compile's launch (the custom op)
    pdl = launcher is _plain and dependent_launch(query, batch * length, _triton.DECODE_PDL_MAX_TOKENS)
    first_n = prefetched_keys(chunk, block_n, (k_dim + v_dim) * element) if written is not None and (
        pdl or TRITON_INTERPRETING) else 0
    launcher(_decode_partial)[(batch * kv_heads, splits)](
        query, key, value, mask_arg, work, written if first_n else work,
        *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *mask_strides,
        kv_heads, kv_length, length, causal_offset(length, kv_length, mask is not None), chunk, splits, parts,
        SCALE=scale, G=groups, HAS_MASK=mask is not None, BLOCK_R=block_rows, BLOCK_N=block_n,
        DQ=q_dim, DK=k_dim, DV=v_dim, PAIRED=k_dim == 2 * q_dim,
        FIRST_N=first_n, PDL=pdl, PRECISION=dot_precision(query.dtype), num_warps=PARTIAL_NUM_WARPS, num_stages=stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return work, splits, parts, block_rows


def decode_attention_kernels(query, key, value, mask, scale: float, launcher=_plain) -> torch.Tensor:
    """The two launches. Called directly in eager mode: the custom op's dispatch costs more than the kernels
    in a CPU-bound decoding step. `launcher` wraps each kernel (for the op: graph capture)."""
    batch, q_heads, length, _ = query.shape
    kv_heads, v_dim = key.shape[1], value.shape[-1]
    work, splits, parts, block_rows = _partial_softmaxes(query, key, value, mask, scale, launcher)
    out = torch.empty(batch, length, q_heads, v_dim, dtype=query.dtype, device=query.device)
    groups = q_heads // kv_heads
    launcher(_decode_reduce)[(batch * kv_heads, groups * length)](  # a program per query row
        work, out, *out.stride()[:3], kv_heads, length, splits, parts, G=groups, BLOCK_R=block_rows,
        DV=v_dim, MAX_SPLITS=next_power_of_2(splits), num_warps=REDUCE_NUM_WARPS,
    )
    return out


def combined_decode_kernels(query, key, value, mask, scale: float, combine, out=None, advance=None) -> torch.Tensor:
    """The two launches of a decoding step with the differential term in the reduce (eager only); see
    `decode.combined_decode_attention`, which defines `combine` (V1Combine, V2Combine or DexCombine), `out` and
    `advance`."""
    batch, q_heads, length, _ = query.shape
    kv_heads, v_dim = key.shape[1], value.shape[-1]
    mode = type(combine).MODE  # 0 V1, 1 V2, 2 DEX: the reduce kernel's MODE
    heads = q_heads if mode == 2 else q_heads // 2  # V1, V2: a head per pair of query heads
    groups = q_heads // kv_heads
    work, splits, parts, block_rows = _partial_softmaxes(query, key, value, mask, scale, _plain, advance)
    if out is None:
        out = torch.empty(batch, length, heads, v_dim, dtype=query.dtype, device=query.device)
    unused = out  # a pointer the mode does not read
    logits, norm, vectors, dex = (unused, 0, 0, 0), (unused, 0.0, 1.0), (unused,) * 4, (unused,) * 3
    anneal, lambda_init, d_lambda = (unused, 1.0), 0.0, 16
    if mode == 0:  # V1Combine
        norm, vectors = (combine.norm_weight, combine.eps, combine.norm_scale), combine.lambda_vectors
        lambda_init, d_lambda = combine.lambda_init, vectors[0].shape[0]
    else:  # V2Combine, DexCombine: the anneal step t and T (ANNEALED is False when T = 0: annealing off)
        anneal = (combine.anneal_step, float(max(combine.anneal_steps, 1)))
        if mode == 1:
            logits = (combine.noise_logits, *combine.noise_logits.stride())
        else:
            dex = (combine.operator.contiguous(), combine.head_mask, combine.lambda_learn)
            lambda_init = combine.lambda_init
    # A program per query row (DEX) or pair of rows (V1, V2): the group's (heads / kv heads) x L outputs.
    pdl = dependent_launch(query, batch * length, _triton.DECODE_PDL_MAX_TOKENS)
    max_splits = next_power_of_2(splits)
    _decode_reduce_combined[(batch * kv_heads, heads // kv_heads * length)](
        work, out, *out.stride()[:3], kv_heads, length, splits, parts,
        *logits, *norm, *vectors, *dex, *anneal, lambda_init, out if advance is None else advance,
        G=groups, BLOCK_R=block_rows, DV=v_dim, MAX_SPLITS=max_splits,
        MODE=mode, ANNEALED=mode != 0 and combine.anneal_steps > 0, D_LAMBDA=d_lambda, ADVANCE=advance is not None,
        PDL=pdl, num_warps=REDUCE_NUM_WARPS_FEW_SPLITS if max_splits <= REDUCE_FEW_SPLITS else REDUCE_NUM_WARPS,
        launch_pdl=pdl,
    )
    return out


# A custom op: torch.compile (fullgraph=True too) keeps it as one node of the graph and runs the kernels.
@triton_op("modeling_diff::decode_attention", mutates_args=())
def decode_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return decode_attention_kernels(query, key, value, mask, scale, launcher=_traceable)
