"""The decoding step's greedy choice (`kernels/greedy.py`) against torch.argmax: the same tokens for every row, ties
(the first index), NaN (the largest value, its first index), infinities, rows of -inf, any vocabulary size; the
ticket counters back at zero after each launch; everything the kernel does not take goes to torch.argmax."""

import pytest
import torch

import modeling_diff.kernels.greedy as greedy
from modeling_diff.kernels import greedy_step, greedy_tokens
from modeling_diff.kernels._triton import tickets_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = greedy.BLOCK


def launched(monkeypatch) -> list:
    """The launches of the kernel from now on (the kernel is still run)."""
    calls, kernel = [], greedy._greedy_tokens
    monkeypatch.setattr(greedy, "_greedy_tokens", type("Counted", (), {
        "__getitem__": lambda self, grid: (calls.append(grid), kernel[grid])[1],
    })())
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab", [(1, 3 * BLOCK + 17), (3, BLOCK), (2, 5), (5, 2 * BLOCK - 1)])
def test_the_tokens_are_torch_argmax(rows, vocab, dtype, monkeypatch):
    torch.manual_seed(rows * vocab)
    scores = torch.randn(rows, vocab, device=DEVICE).to(dtype)
    calls = launched(monkeypatch)
    assert torch.equal(greedy_tokens(scores), torch.argmax(scores, -1))
    assert calls == [(rows, -(-vocab // BLOCK))]  # one launch: a program per BLOCK scores of a row
    assert not tickets_of(greedy.greedy_tokens, greedy.MAX_ROWS, scores.device).any()


def test_ties_nan_and_infinities_as_torch_argmax(monkeypatch):
    """Each row is a case torch.argmax decides by its rule: ties across and within parts (the first index), NaN
    above +inf (the first NaN), a row of -inf (index 0), +inf in two parts, -0.0 equal to 0.0."""
    vocab = 3 * BLOCK
    scores = torch.randn(7, vocab, device=DEVICE)
    scores[0, [BLOCK + 5, 2 * BLOCK + 1, 2 * BLOCK + 2]] = 9.0  # a tie across parts and within one
    scores[1, [2 * BLOCK - 1, BLOCK + 3]] = float("nan")
    scores[1, 0] = float("inf")
    scores[2] = float("-inf")
    scores[3, [BLOCK, 2 * BLOCK + 7]] = float("inf")
    scores[4] = -1.0
    scores[4, [10, BLOCK + 1]] = torch.tensor([-0.0, 0.0], device=DEVICE)
    scores[5, vocab - 1] = float("nan")  # the last score of the last part
    scores[6, :] = 0.5  # every score equal
    calls = launched(monkeypatch)
    assert greedy_tokens(scores).tolist() == torch.argmax(scores.cpu(), -1).tolist()
    assert calls


def test_out_receives_the_tokens_in_a_view(monkeypatch):
    """`out` may be a strided view of a graph's buffer (bench.py's (B, 1) token column); it is written in place."""
    scores = torch.randn(3, 2 * BLOCK + 3, device=DEVICE, dtype=torch.bfloat16)
    buffer = torch.full((3, 2), -1, dtype=torch.long, device=DEVICE)
    calls = launched(monkeypatch)
    tokens = greedy_tokens(scores, out=buffer[:, 1])
    assert tokens.data_ptr() == buffer[:, 1].data_ptr() and calls
    assert buffer[:, 1].tolist() == torch.argmax(scores, -1).tolist() and buffer[:, 0].tolist() == [-1] * 3


def test_rows_apart_in_memory(monkeypatch):
    """The last position's scores of (B, L, V) logits: rows L x V apart, as a model's output gives them."""
    logits = torch.randn(3, 4, 2 * BLOCK + 9, device=DEVICE, dtype=torch.bfloat16)
    calls = launched(monkeypatch)
    assert torch.equal(greedy_tokens(logits[:, -1]), torch.argmax(logits[:, -1], -1)) and calls


def test_a_bad_out_is_refused():
    scores = torch.randn(2, 10, device=DEVICE)
    for out in (torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.int32)):
        with pytest.raises(ValueError, match="out must be int64 of shape"):
            greedy_tokens(scores, out=out.to(DEVICE))


@pytest.mark.parametrize("case", ["float64", "gradients", "one_dim", "strided", "rows"])
def test_what_the_kernel_does_not_take_goes_to_torch_argmax(case, monkeypatch):
    scores = torch.randn(3, 40, device=DEVICE)
    if case == "float64":
        scores = scores.double()
    elif case == "gradients":
        scores.requires_grad_()
    elif case == "one_dim":
        scores = scores[0]
    elif case == "strided":
        scores = scores.t()
    else:
        monkeypatch.setattr(greedy, "MAX_ROWS", 2)
    calls = launched(monkeypatch)
    assert torch.equal(greedy_tokens(scores), torch.argmax(scores, -1)) and not calls


class Owner:  # the object whose tickets a launch takes (weak-referenced)
    pass


def step_buffers(rows: int, slots: int, eos: list[int], generated: int, min_generated: int, cache_index: int,
                 pad: int, generator: torch.Generator) -> dict:
    """The buffers of `greedy_step` (as GreedyStepGraph keeps them) mid-generation: some rows finished, earlier
    tokens recorded, random positions."""
    long = dict(dtype=torch.long, device=DEVICE)
    visible = torch.zeros(rows, 1, 1, slots, dtype=torch.bool, device=DEVICE)
    visible[..., : cache_index + 1] = True
    return dict(
        token=torch.randint(0, 50, (rows, 1), generator=generator).to(**long),
        position=torch.randint(0, slots, (rows, 1), generator=generator).to(**long),
        visible=visible,
        counters=torch.tensor([generated, min_generated, cache_index, pad], **long),
        eos=torch.tensor(eos, **long),
        unfinished=(torch.rand(rows, generator=generator) < 0.7).to(DEVICE),
        chosen=torch.randint(0, 50, (rows, slots), generator=generator).to(**long),
        alive=torch.ones(slots, dtype=torch.bool, device=DEVICE),
    )


def recorded(scores: torch.Tensor, b: dict, monkeypatch) -> dict:
    """GreedyStepGraph.record, the kernel's reference, on a copy of the buffers b, its choice torch.argmax."""
    from modeling_diff import generation
    from modeling_diff.generation import GreedyStepGraph

    monkeypatch.setattr(generation, "greedy_tokens", lambda scores, owner: torch.argmax(scores, -1))

    steps = GreedyStepGraph.__new__(GreedyStepGraph)  # its buffers only: record reads no model
    for name, tensor in b.items():
        setattr(steps, "tokens" if name == "chosen" else name, tensor.clone())
    steps.generated, steps.min_generated, steps.cache_index, steps.pad = (steps.counters[i:i + 1] for i in range(4))
    steps.record(scores)
    return {name: getattr(steps, "tokens" if name == "chosen" else name) for name in b}


@pytest.mark.parametrize("eos", [[], [3], [3, 2 * BLOCK + 1, 7]])
@pytest.mark.parametrize("suppressed", [True, False])
def test_a_generation_step_in_the_choice_launch_is_its_torch_reference(eos, suppressed, monkeypatch):
    """`greedy_step` against `GreedyStepGraph.record` (torch operations): the EOS ids' scores -inf while generated <
    min_generated, the pad token on finished rows, an EOS chosen finishing its row, the token recorded, the next
    input, position and mask slot, `alive` and the counters; over steps that choose EOS on some rows (the largest
    score), with ties and NaN; one launch each, the tickets back at zero."""
    generator = torch.Generator().manual_seed(len(eos) + suppressed)
    rows, vocab, slots = 5, 2 * BLOCK + 40, 12
    b = step_buffers(rows, slots, eos, 2, 4 if suppressed else 1, 6, pad=11, generator=generator)
    owner, calls = Owner(), launched(monkeypatch)
    for step in range(3):
        scores = torch.randn(rows, vocab, generator=generator).to(DEVICE)
        if eos:
            scores[step % rows, eos[-1]] = 50.0  # an EOS is the largest score of one row
            scores[(step + 1) % rows, eos[0]] = float("nan")  # NaN on an EOS: the row's choice unless suppressed
        scores[(step + 2) % rows, [BLOCK - 1, BLOCK + 5]] = 60.0  # a tie across parts
        want = recorded(scores, b, monkeypatch)
        assert greedy_step(scores, **b, owner=owner)
        for name in b:
            assert torch.equal(b[name], want[name]), (step, name)
    assert len(calls) == 3
    assert not tickets_of(owner, greedy.MAX_ROWS + 1, scores.device).any()
    assert b["counters"].tolist()[0] == 5 and b["visible"][..., 9].all()


def test_a_generation_step_the_kernel_does_not_take_writes_nothing(monkeypatch):
    """Buffers of another layout or dtype, or too many EOS ids: `greedy_step` returns False and writes nothing (the
    caller's torch reference then runs)."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 300, device=DEVICE)
    calls = launched(monkeypatch)
    for name, bad in [("token", lambda t: t.int()), ("visible", lambda t: t.long()),
                      ("chosen", lambda t: t.t().contiguous().t()), ("eos", lambda t: torch.arange(65, device=DEVICE))]:
        b = step_buffers(2, 8, [3], 1, 0, 3, pad=0, generator=generator)
        b[name] = bad(b[name])
        before = {k: v.clone() for k, v in b.items()}
        assert not greedy_step(scores, **b, owner=Owner())
        assert all(torch.equal(b[k], before[k]) for k in b)
    assert not greedy_step(scores.double(), **step_buffers(2, 8, [3], 1, 0, 3, 0, generator), owner=Owner())
    assert not calls
