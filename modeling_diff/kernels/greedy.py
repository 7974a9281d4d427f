"""The greedy choice of a decoding step: torch.argmax(scores, -1) in one launch (`triton_greedy.py`).

    greedy_tokens(scores (B, V), out=None) -> (B,) int64, the first index of each row's maximum (NaN the largest)
    greedy_step(scores, *, token, position, visible, counters, eos, unfinished, chosen, alive, owner) -> bool:
        the same choice and a greedy generation step's bookkeeping in the same launch (generate()'s graph)

PyTorch reduces a row of a few tens of thousands of scores in one thread block: 10 us a step at batch 1 on the
H200, the longest of a decoding step's small kernels (benchmarks/RESULTS.md), where the bytes take well under one.
The kernel spreads each row over programs of BLOCK scores and merges their candidates in the last one to finish.
It applies without gradients to float32, bfloat16 and float16 scores on the kernels' devices (CUDA, or the
interpreter on the CPU), at most MAX_ROWS rows; everything else is torch.argmax.
"""

import torch

from ._triton import (
    TRITON_AVAILABLE, cdiv, dependent_launch, eager_kernels_run_on, needs_grad, next_power_of_2, tickets_of,
)

if TRITON_AVAILABLE:
    from .triton_greedy import _greedy_tokens

BLOCK = 1024  # scores a program
MAX_ROWS = 1024  # rows a launch: one ticket each (and one for a generation step), allocated once per owner and device
MAX_EOS = 64  # EOS ids a generation step compares with each score
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def greedy_tokens_applies(scores: torch.Tensor) -> bool:
    return (
        eager_kernels_run_on(scores)
        and type(scores) is torch.Tensor
        and scores.dim() == 2 and 0 < scores.shape[0] <= MAX_ROWS and 0 < scores.shape[1] < 2**31 - BLOCK
        and scores.dtype in _DTYPES and scores.stride(-1) == 1 and not needs_grad(scores)
    )


def greedy_tokens(scores: torch.Tensor, out: torch.Tensor | None = None, owner: object = None) -> torch.Tensor:
    """torch.argmax(scores, -1) for scores (B, V): the kernel where it applies. `out` (B,) int64 receives the tokens
    (a view of a graph's buffer, say), else a new tensor. `owner`: the object whose ticket counters the launch takes
    (`_triton.tickets_of`), one for each stream that launches it (a generation graph); else one for all."""
    if out is not None and (out.shape != scores.shape[:1] or out.dtype != torch.long or out.device != scores.device):
        raise ValueError(f"greedy_tokens: out must be int64 of shape ({scores.shape[0]},) on {scores.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    if not greedy_tokens_applies(scores):
        return torch.argmax(scores, -1, out=out) if out is not None else torch.argmax(scores, -1)
    tokens = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device) if out is None else out
    unused = tokens  # the step's pointers, not read without STEP
    step = (unused,) * 4 + (0,) + (unused,) * 3 + (0, 0, scores.shape[0])
    _launch(scores, greedy_tokens if owner is None else owner, tokens, tokens.stride(0), step, False, 0)
    return tokens


def _launch(scores: torch.Tensor, owner: object, tokens: torch.Tensor, token_stride: int, step: tuple, is_step: bool,
            eos: int) -> None:
    """One `_greedy_tokens` launch over scores (B, V): the tokens into `tokens` (stride `token_stride`); `step`: the
    generation step's arguments (Counters .. ROWS) where `is_step`, else placeholders; `eos`: the EOS ids (STEP).
    Each part's best score and its index in buffers of this launch; the owner's tickets, a row's and the step's."""
    rows, vocab = scores.shape
    parts = cdiv(vocab, BLOCK)
    best = torch.empty(rows, parts, dtype=torch.float32, device=scores.device)
    best_at = torch.empty(rows, parts, dtype=torch.int32, device=scores.device)
    tickets = tickets_of(owner, MAX_ROWS + 1, scores.device)  # 0 between launches
    pdl = dependent_launch(scores, rows)
    try:
        _greedy_tokens[(rows, parts)](
            scores, best, best_at, tickets, tokens, scores.stride(0), token_stride, vocab, *step,
            PARTS=parts, PARTS_POW2=next_power_of_2(parts), BLOCK=BLOCK, STEP=is_step, MAX_ROWS=MAX_ROWS, EOS=eos,
            EOS_POW2=next_power_of_2(max(eos, 1)), ROWS_POW2=next_power_of_2(rows) if is_step else 1,
            PDL=pdl, launch_pdl=pdl,
        )
    except BaseException:  # a launch cut short (the interpreter's programs run one by one) leaves no ticket taken
        tickets.zero_()
        raise


def _contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.is_contiguous() and type(t) is torch.Tensor for t in tensors)


def greedy_step(scores: torch.Tensor, *, token: torch.Tensor, position: torch.Tensor, visible: torch.Tensor,
                counters: torch.Tensor, eos: torch.Tensor, unfinished: torch.Tensor, chosen: torch.Tensor,
                alive: torch.Tensor, owner: object) -> bool:
    """A greedy generation step's choice and bookkeeping in the one launch of the choice, where the kernel applies;
    -> whether it ran (else nothing is written: the caller runs its torch reference, `GreedyStepGraph.record`).
    The buffers, B rows, S cache slots, E EOS ids: scores (B, V); token, position (B, 1) int64, the next step's input
    and its position (+1); visible (B, 1, 1, S) bool, the next step's mask (slot cache_index + 1 set); counters (4,)
    int64 = (generated, min_generated, cache_index, pad), generated and cache_index advanced; eos (E,) int64;
    unfinished (B,) bool; chosen (B, S) int64, the token recorded at column generated; alive (S,) bool, whether any
    row is unfinished after step `generated`. The EOS ids' scores count as -inf while generated < min_generated;
    a finished row takes the pad token. `owner`: whose tickets (one per stream that launches it)."""
    rows = scores.shape[0]
    if not (
        greedy_tokens_applies(scores)
        and _contiguous(token, position, visible, counters, eos, unfinished, chosen, alive)
        and token.shape == position.shape == (rows, 1) and visible.shape[:3] == (rows, 1, 1)
        and counters.shape == (4,) and eos.dim() == 1 and eos.numel() <= MAX_EOS
        and unfinished.shape == (rows,) and chosen.shape[0] == rows
        and all(t.dtype == torch.long for t in (token, position, counters, eos, chosen))
        and all(t.dtype == torch.bool for t in (visible, unfinished, alive))
        and all(t.device == scores.device for t in (token, position, visible, counters, eos, unfinished, chosen, alive))
    ):
        return False
    step = (counters, eos, unfinished, chosen, chosen.stride(0), alive, position, visible, visible.stride(0),
            visible.shape[-1], rows)
    _launch(scores, owner, token, 1, step, True, eos.numel())
    return True
