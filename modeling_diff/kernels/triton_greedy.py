"""Triton: the greedy token of each row of a decoding step's scores, torch.argmax(scores, -1), in one launch.

Imported only when triton is installed (see `kernels/greedy.py` for the dispatch; the reference is torch.argmax).
Program (row, part) takes BLOCK scores of its row and stores their first maximum and its index; each program
then takes a ticket of its row (an atomic add, acquire-release), and the one with the last ticket merges the
row's PARTS candidates, stores the token and puts the ticket back to 0. NaN is the largest value, as in
torch.argmax; among equal maxima the first index wins, within a part and across parts (parts are in order). With
STEP the merging program also does a generation step's bookkeeping (`_record_step`).
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


@triton.jit
def _eos_hit(tokens, Eos, EOS: tl.constexpr, EOS_POW2: tl.constexpr):
    # whether each of `tokens` (any shape, 1-D here) is one of the EOS ids; ids outside the vocabulary match nothing
    e = tl.arange(0, EOS_POW2)
    eos = tl.load(Eos + e, mask=e < EOS, other=-1)
    return tl.sum((tokens[:, None] == eos[None, :]).to(tl.int32), axis=1) > 0


@triton.jit
def _record_step(token, row, Tickets, Tokens, stride_token, Counters, Eos, Unfinished, Chosen, stride_chosen, Alive,
                 Position, Visible, stride_visible, S, ROWS, MAX_ROWS: tl.constexpr, EOS: tl.constexpr,
                 EOS_POW2: tl.constexpr, ROWS_POW2: tl.constexpr):
    # A generation step's bookkeeping for one row's greedy token (`generation.GreedyStepGraph.record`, its torch
    # reference): Counters = (generated, min_generated, cache_index, pad). A finished row takes the pad token and an
    # EOS finishes it; the token is recorded at column `generated`, becomes the next input, its position advances
    # and the next cache slot becomes visible. The last row to finish (a ticket of its own, after the rows') records
    # whether any row is unfinished and advances the counters, which every program read before its ticket.
    generated = tl.load(Counters)
    chosen = token.to(tl.int64)
    if EOS > 0:
        unfinished = tl.load(Unfinished + row)
        chosen = tl.where(unfinished, chosen, tl.load(Counters + 3))
        hit = tl.max(_eos_hit(chosen + tl.zeros((1,), tl.int64), Eos, EOS, EOS_POW2).to(tl.int32), axis=0) > 0
        tl.store(Unfinished + row, unfinished & ~hit)
    tl.store(Chosen + row * stride_chosen + generated, chosen)
    tl.store(Tokens + row * stride_token, chosen)
    tl.store(Position + row, tl.load(Position + row) + 1)
    next_index = tl.load(Counters + 2) + 1
    tl.store(Visible + row * stride_visible + next_index, tl.full((), 1, tl.int1), mask=next_index < S)
    tl.debug_barrier()  # every thread's stores before the ticket's release
    if tl.atomic_add(Tickets + MAX_ROWS, 1, sem="acq_rel") == ROWS - 1:
        rows = tl.arange(0, ROWS_POW2)
        unfinished_rows = tl.load(Unfinished + rows, mask=rows < ROWS, other=False, cache_modifier=".cg")
        tl.store(Alive + generated, tl.max(unfinished_rows.to(tl.int32), axis=0) > 0)
        tl.store(Counters, generated + 1)
        tl.store(Counters + 2, next_index)
        tl.store(Tickets + MAX_ROWS, 0)


@triton.jit(do_not_specialize=["V", "S", "ROWS"])  # the vocabulary, cache and batch sizes: one kernel for all
def _greedy_tokens(
    Scores, Best, BestAt, Tickets, Tokens, stride_row, stride_token, V,
    Counters, Eos, Unfinished, Chosen, stride_chosen, Alive, Position, Visible, stride_visible, S, ROWS,
    PARTS: tl.constexpr, PARTS_POW2: tl.constexpr, BLOCK: tl.constexpr, STEP: tl.constexpr, MAX_ROWS: tl.constexpr,
    EOS: tl.constexpr, EOS_POW2: tl.constexpr, ROWS_POW2: tl.constexpr, PDL: tl.constexpr,
):
    # STEP: a generation step's choice (`_record_step`), the EOS ids' scores -inf while generated < min_generated;
    # else the tokens alone into Tokens (the other pointers unused)
    let_dependents_start(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    wait_for_inputs(PDL)  # the scores are the kernel's before (lm_head)
    x = tl.load(Scores + row.to(tl.int64) * stride_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
    if STEP and EOS > 0:
        suppressed = tl.load(Counters) < tl.load(Counters + 1)
        x = tl.where(_eos_hit(cols, Eos, EOS, EOS_POW2) & suppressed, float("-inf"), x)
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
        tl.store(Tickets + row, 0)
        if STEP:
            _record_step(token, row, Tickets, Tokens, stride_token, Counters, Eos, Unfinished, Chosen, stride_chosen,
                         Alive, Position, Visible, stride_visible, S, ROWS, MAX_ROWS, EOS, EOS_POW2, ROWS_POW2)
        else:
            tl.store(Tokens + row * stride_token, token.to(tl.int64))
