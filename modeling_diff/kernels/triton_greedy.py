"""Triton: the greedy token of each row of a decoding step's scores, torch.argmax(scores, -1), in one launch.

Imported only when triton is installed (see `kernels/greedy.py` for the dispatch; the reference is torch.argmax).
Program (row, part) takes BLOCK scores of its row and stores their first maximum and its index; each program
then takes a ticket of its row (an atomic add, acquire-release), and the one with the last ticket merges the
row's PARTS candidates, stores the token and puts the ticket back to 0. NaN is the largest value, as in
torch.argmax; among equal maxima the first index wins, within a part and across parts (parts are in order).
"""

# In a try block because transformers' remote-code loader requires every *unguarded* import of a Hub export's
# files to be installed; this module is imported only where triton is (see _triton.TRITON_AVAILABLE).
try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("modeling_diff's Triton kernels need the triton package") from error

from .triton_launch import let_dependents_start, wait_for_inputs


@triton.jit
def _first_maximum(x, at, ok):
    # (the largest of x where ok, NaN above everything; its first `at`) of a block: x float32, at int32
    nan = (x != x) & ok
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(nan | ~ok, float("-inf"), x), axis=0)
    hit = tl.where(any_nan, nan, (x == top) & ok)
    first = tl.min(tl.where(hit, at, 2147483647), axis=0)
    return tl.where(any_nan, float("nan"), top), first


@triton.jit(do_not_specialize=["V"])  # the vocabulary size: one kernel for every model
def _greedy_tokens(
    Scores, Best, BestAt, Tickets, Tokens, stride_row, stride_token, V,
    PARTS: tl.constexpr, PARTS_POW2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    let_dependents_start(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    wait_for_inputs(PDL)  # the scores are the kernel's before (lm_head)
    x = tl.load(Scores + row.to(tl.int64) * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    best, best_at = _first_maximum(x, cols, ok)
    tl.store(Best + row * PARTS + part, best)
    tl.store(BestAt + row * PARTS + part, best_at)
    tl.debug_barrier()  # every thread's store before the ticket's release
    if tl.atomic_add(Tickets + row, 1, sem="acq_rel") == PARTS - 1:
        parts = tl.arange(0, PARTS_POW2)
        here = parts < PARTS
        # past L1 (.cg): the candidates are other programs' stores of this launch
        values = tl.load(Best + row * PARTS + parts, mask=here, other=float("-inf"), cache_modifier=".cg")
        ats = tl.load(BestAt + row * PARTS + parts, mask=here, other=0, cache_modifier=".cg")
        _, first_part = _first_maximum(values, parts, here)
        token = tl.sum(tl.where(parts == first_part, ats, 0), axis=0)
        tl.store(Tokens + row * stride_token, token.to(tl.int64))
        tl.store(Tickets + row, 0)
