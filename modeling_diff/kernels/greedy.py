"""The greedy choice of a decoding step: torch.argmax(scores, -1) in one launch (`triton_greedy.py`).

    greedy_tokens(scores (B, V), out=None) -> (B,) int64, the first index of each row's maximum (NaN the largest)

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
MAX_ROWS = 1024  # rows a launch: one ticket each, allocated once per owner and device
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
    rows, vocab = scores.shape
    parts = cdiv(vocab, BLOCK)
    tokens = torch.empty(rows, dtype=torch.long, device=scores.device) if out is None else out
    best = torch.empty(rows, parts, dtype=torch.float32, device=scores.device)
    best_at = torch.empty(rows, parts, dtype=torch.int32, device=scores.device)
    tickets = tickets_of(greedy_tokens if owner is None else owner, MAX_ROWS, scores.device)  # 0 between launches
    pdl = dependent_launch(scores, rows)
    try:
        _greedy_tokens[(rows, parts)](
            scores, best, best_at, tickets, tokens, scores.stride(0), tokens.stride(0), vocab,
            PARTS=parts, PARTS_POW2=next_power_of_2(parts), BLOCK=BLOCK, PDL=pdl, launch_pdl=pdl,
        )
    except BaseException:  # a launch cut short (the interpreter's programs run one by one) leaves no ticket taken
        tickets.zero_()
        raise
    return tokens
