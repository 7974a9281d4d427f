"""Needle-in-a-haystack evaluation for any causal LM with a tokenizer.

N needles ("The special magic number for <key> is <value>.") are planted in filler text; R of them are
asked for ("... The special magic number for <key> is") and an answer counts as retrieved when greedy
decoding would produce exactly its value: every value token is the argmax given the prompt and the value
tokens before it (teacher forcing, one forward pass per query instead of a generate loop). The R queried
needles sit together at the swept depth, the N - R others (distractors) at random depths, as in the
multi-needle evaluation of DIFF Transformer (arXiv 2410.05258, Sec. 3.4). Depth d puts the queried needles
after a fraction d of the filler text. The grid is context length (every token the model reads for a query:
context, question and the answer tokens fed back by teacher forcing, so a model with learned positions is never
asked beyond its `max_position_embeddings`) x depth; each cell holds the share of queries retrieved over `trials`
random draws of keys, values and filler offset.

    result = evaluate_needles(model, tokenizer, lengths=[1024, 2048], depths=[0, 0.5, 1], num_needles=4, num_queries=2)
    print(result.summary()); plot_needle_heatmap(result)

Command line (writes needle.json and needle.png into --out):

    python -m modeling_diff.needle MODEL_DIR [--gguf-file F] --lengths 1024 2048 --needles 4 --queries 2 --out results/
"""

import argparse
import contextlib
import json
import math
import random
import re
import secrets
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .atomic import atomic_directory, check_writable, locked_staging, signals_deferred, sigterm_as_interrupt
from .checkpoint_files import (CONFIG_FILES, LOADING_ERRORS, MAX_WHOLE_READ_BYTES, SIDE_FILES, check_loading_info,
                               check_gguf, check_side_files, check_weight_files, first_non_finite,
                               load_tokenizer)
from .data import shakespeare
from .extras import require
from .text_files import read_text_file

# A needle is NEEDLE_HEAD + " <value>." and a question ends with NEEDLE_HEAD, so the answer " <value>" is
# tokenized the same way in the context and after the question.
NEEDLE_HEAD = "The special magic number for {key} is"
QUESTION_TEMPLATE = "What is the special magic number for {key}? " + NEEDLE_HEAD
KEYS = (
    "Paris", "Lisbon", "Oslo", "Cairo", "Lima", "Dublin", "Vienna", "Prague", "Madrid", "Athens",
    "Berlin", "Warsaw", "Nairobi", "Quito", "Hanoi", "Seoul", "Tokyo", "Ottawa", "Havana", "Manila",
    "Rome", "Sofia", "Riga", "Tunis", "Dakar", "Accra", "Kyiv", "Minsk", "Bogota", "Santiago",
)
VALUE_DIGITS = 4


@dataclass(frozen=True)
class Needle:
    key: str
    value: str

    @property
    def sentence(self) -> str:
        return f"{NEEDLE_HEAD.format(key=self.key)} {self.value}."


@dataclass
class NeedlePrompt:
    """One query: `input_ids` is the context and the question; `answer_ids` should follow it. The model reads
    `input_ids + answer_ids[:-1]` (teacher forcing)."""

    input_ids: list[int]
    answer_ids: list[int]
    needle: Needle
    value_span: tuple[int, int]  # [start, end) of the queried needle's value tokens inside input_ids


def _check_num_needles(count: int) -> None:
    if not 1 <= count <= len(KEYS):
        raise ValueError(f"num_needles must be in [1, {len(KEYS)}], got {count}")


def make_needles(count: int, rng: random.Random) -> list[Needle]:
    """`count` needles with distinct keys and random VALUE_DIGITS-digit values."""
    _check_num_needles(count)
    keys = rng.sample(KEYS, count)
    return [Needle(key, str(rng.randrange(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS))) for key in keys]


class NeedlePromptBuilder:
    """Tokenizes the haystack once and builds prompts of an exact token length by token concatenation."""

    def __init__(self, tokenizer, haystack: str):
        self.tokenizer = tokenizer
        self.haystack_ids = self._encode(haystack)
        if not self.haystack_ids:
            raise ValueError("haystack must contain text, got an empty string")
        # Tokenizers that add a BOS token get it at the start of every prompt, as the model saw in training.
        bos = tokenizer.bos_token_id
        self.prefix_ids = [bos] if bos is not None and tokenizer("a").input_ids[:1] == [bos] else []

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _head(self, key: str) -> list[int]:
        return self._encode(" " + NEEDLE_HEAD.format(key=key))

    def _question(self, key: str) -> list[int]:
        return self._encode("\n\n" + QUESTION_TEMPLATE.format(key=key))

    def fixed_tokens(self, sentences: list[int], questions: list[int], values: list[int]) -> int:
        """The tokens of a prompt that are not filler: the prefix, the needles' `sentences` (head, value and ".")
        and the longest of the questions read after the context with their answers but its last token."""
        return len(self.prefix_ids) + sum(sentences) + max(q + v - 1 for q, v in zip(questions, values))

    def check_room(self, length: int, fixed: int, what: str) -> None:
        if length <= fixed:
            raise ValueError(f"lengths must leave room for filler text: {length} tokens hold no more than the "
                             f"{fixed} tokens of {what}")

    def most_fixed_tokens(self, num_needles: int) -> int:
        """The most tokens `num_needles` needles and a question on one of them can take in a prompt over every draw
        of `make_needles` (the filler takes the rest): the longest value, the sentences of the keys with the longest
        ones, the longest question. (The longest keys in characters, the first of them queried, missed the draws
        that query a longer one: the check passed and a later cell raised.)"""
        values = range(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS)
        value = max(map(len, self.tokenizer([f" {v}" for v in values], add_special_tokens=False).input_ids))
        tail = len(self._encode("."))
        sentences = sorted(len(self._head(key)) + value + tail for key in KEYS)[-num_needles:]
        return self.fixed_tokens(sentences, [max(len(self._question(key)) for key in KEYS)], [value])

    def build(
        self, length: int, depth: float, needles: list[Needle], num_queries: int, rng: random.Random
    ) -> list[NeedlePrompt]:
        """Prompts for the first `num_queries` needles, each read with its answer in at most `length` tokens
        (`input_ids + answer_ids[:-1]`); the queried needles sit together at `depth` (0 = start of the filler,
        1 = end), the others at random depths."""
        # (head, value, tail) token pieces of each needle; the value span is known exactly by construction.
        pieces = [(self._head(n.key), self._encode(" " + n.value), self._encode(".")) for n in needles]
        questions = [self._question(n.key) for n in needles[:num_queries]]
        fixed = self.fixed_tokens([len(h) + len(v) + len(t) for h, v, t in pieces], [len(q) for q in questions],
                                  [len(v) for _, v, _ in pieces])
        self.check_room(length, fixed, f"{len(needles)} needles and a question")
        filler_length = length - fixed
        # The haystack repeats when it is shorter than the filler (the usual practice for long contexts).
        start = rng.randrange(len(self.haystack_ids))
        repeats = (start + filler_length) // len(self.haystack_ids) + 1
        filler = (self.haystack_ids * repeats)[start : start + filler_length]

        points = [round(depth * filler_length)] * num_queries  # the queried needles share one insertion point
        points += [rng.randrange(filler_length + 1) for _ in needles[num_queries:]]
        context, value_spans, previous = list(self.prefix_ids), {}, 0
        for index in sorted(range(len(needles)), key=lambda i: (points[i], i)):
            context += filler[previous : points[index]]
            previous = points[index]
            head, value, tail = pieces[index]
            value_spans[index] = (len(context) + len(head), len(context) + len(head) + len(value))
            context += head + value + tail
        context += filler[previous:]
        return [
            NeedlePrompt(context + questions[i], pieces[i][1], needles[i], value_spans[i]) for i in range(num_queries)
        ]


@torch.no_grad()
def score_prompt(model, prompt: NeedlePrompt) -> tuple[bool, float]:
    """(retrieved, log-probability of the answer): greedy decoding would emit the answer iff every answer token
    is the argmax after the prompt and the answer tokens before it."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt.input_ids + prompt.answer_ids[:-1]], device=device)
    n = len(prompt.answer_ids)
    logits = model(input_ids=ids, logits_to_keep=n, use_cache=False).logits[0].float()  # (n, V): answer token i
    # is predicted after the prompt and answer tokens < i
    answer = torch.tensor(prompt.answer_ids, device=device)
    retrieved = bool((logits.argmax(-1) == answer).all())
    logprob = float(logits.log_softmax(-1).gather(-1, answer[:, None]).sum())
    return retrieved, logprob


@dataclass
class NeedleResult:
    lengths: list[int]
    depths: list[float]
    num_needles: int
    num_queries: int
    trials: int
    accuracy: list[list[float]]  # [length][depth]: share of queries retrieved
    answer_logprob: list[list[float]]  # [length][depth]: mean log-probability of the answer

    def summary(self) -> str:
        header = "length \\ depth " + " ".join(f"{d:>6.2f}" for d in self.depths)
        rows = [f"{length:>14} " + " ".join(f"{a:>6.2f}" for a in accs) for length, accs in zip(self.lengths, self.accuracy)]
        mean = sum(map(sum, self.accuracy)) / (len(self.lengths) * len(self.depths))
        return "\n".join([f"needle accuracy ({self.num_needles} needles, {self.num_queries} queries, "
                          f"{self.trials} trials per cell); mean {mean:.3f}", header, *rows])

    def to_dict(self) -> dict:
        return asdict(self)


def context_limit(model) -> int | None:
    """The longest context the model's config declares (`max_position_embeddings`, GPT-2's `n_positions`)."""
    return getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)


def default_lengths(model, start: int = 1024) -> list[int]:
    """Powers of two from `start` up to the model's `max_position_embeddings`."""
    limit = context_limit(model)
    if limit is None:
        raise ValueError("lengths must be given: the model's config declares no max_position_embeddings")
    if start > limit:  # (the CLI names `lengths` as --lengths)
        raise ValueError(f"lengths must be given: the default starts at {start} tokens, above the model's "
                         f"max_position_embeddings ({limit})")
    lengths = [start]
    while lengths[-1] * 2 <= limit:
        lengths.append(lengths[-1] * 2)
    return lengths


def check_grid(lengths: list[int] | None, depths, num_needles: int, num_queries: int, trials: int) -> None:
    """The arguments of `evaluate_needles` that need no model (`lengths` None: the model's default), each refused
    with a ValueError naming it."""
    if lengths is not None and (
        not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths)
    ):
        raise ValueError(f"lengths must be a non-empty list of positive integers, got {lengths}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):  # NaN fails both comparisons
        raise ValueError(f"depths must be a non-empty list of fractions in [0, 1], got {depths}")
    _check_num_needles(num_needles)
    if not 1 <= num_queries <= num_needles:
        raise ValueError(f"num_queries must be in [1, num_needles={num_needles}], got {num_queries}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")


def evaluate_needles(
    model,
    tokenizer,
    lengths: list[int] | None = None,
    depths: list[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    num_needles: int = 1,
    num_queries: int = 1,
    trials: int = 1,
    haystack: str | None = None,
    seed: int = 0,
    progress: bool = True,
) -> NeedleResult:
    """Accuracy for every (context length, answer depth) cell. `lengths` defaults to `default_lengths(model)`,
    `haystack` to Hamlet."""
    lengths = list(default_lengths(model) if lengths is None else lengths)
    depths = list(depths)
    check_grid(lengths, depths, num_needles, num_queries, trials)
    limit = context_limit(model)
    if limit is not None and max(lengths) > limit:
        raise ValueError(f"lengths must not exceed max_position_embeddings ({limit}), "
                         f"got {max(lengths)}")
    builder = NeedlePromptBuilder(tokenizer, shakespeare("hamlet") if haystack is None else haystack)
    # too-short lengths refused before any cell runs
    builder.check_room(min(lengths), builder.most_fixed_tokens(num_needles),
                       f"{num_needles} needles and a question at their longest")

    was_training = model.training
    model.eval()
    # per cell: the answers retrieved and the sum of their log-probabilities, divided by the answers once at the end
    # (adding each answer's share gave 0.9999999999999999 for a cell of whole retrieval)
    retrieved_count = [[0] * len(depths) for _ in lengths]
    logprob_sum = [[0.0] * len(depths) for _ in lengths]
    cells = [(i, j) for i in range(len(lengths)) for j in range(len(depths))]
    try:
        for i, j in tqdm(cells, desc="needle cells", disable=not progress):
            for trial in range(trials):
                rng = random.Random(f"{seed}-{lengths[i]}-{depths[j]}-{trial}")
                prompts = builder.build(lengths[i], depths[j], make_needles(num_needles, rng), num_queries, rng)
                for prompt in prompts:
                    retrieved, answer_logprob = score_prompt(model, prompt)
                    if not math.isfinite(answer_logprob):  # NaN logits retrieve nothing: a silent 0.000 otherwise
                        raise ValueError(f"the model's logits hold NaN or inf values (context length {lengths[i]}, "
                                         f"depth {depths[j]}): no answer can be scored; the evaluation was stopped")
                    retrieved_count[i][j] += int(retrieved)
                    logprob_sum[i][j] += answer_logprob
    finally:  # an interrupted evaluation leaves the model as it found it
        model.train(was_training)
    answers = trials * num_queries
    accuracy = [[count / answers for count in row] for row in retrieved_count]
    logprob = [[total / answers for total in row] for row in logprob_sum]
    return NeedleResult(lengths, depths, num_needles, num_queries, trials, accuracy, logprob)


def plot_needle_heatmap(result: NeedleResult, ax=None, title: str | None = None):
    """Accuracy heatmap: context length (rows) x answer depth (columns). Returns the matplotlib Axes.
    Needs matplotlib: pip install 'modeling-diff[needle]'."""
    plt = require("matplotlib.pyplot", "plot_needle_heatmap")

    if ax is None:
        _, ax = plt.subplots(figsize=(1.2 * len(result.depths) + 2, 0.6 * len(result.lengths) + 1.5))
    image = ax.imshow(result.accuracy, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(result.depths)), [f"{d:.0%}" for d in result.depths])
    ax.set_yticks(range(len(result.lengths)), [str(n) for n in result.lengths])
    ax.set_xlabel("answer depth")
    ax.set_ylabel("context length (tokens)")
    for i, row in enumerate(result.accuracy):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.figure.colorbar(image, ax=ax, label="accuracy")
    ax.set_title(title or f"needle in a haystack: N={result.num_needles}, R={result.num_queries}")
    return ax


RESULT_FILES = ("needle.json", "needle.png")
# What the haystack may be (it is read whole): a text of some MB at most; Hamlet is 0.2 MB.
MAX_HAYSTACK_BYTES = MAX_WHOLE_READ_BYTES
# How long the results wait for another writer of --out (another needle run writing there) to release its lock: such
# a writer holds it for the second its files take to write, and an evaluation that ran for hours must not be lost to
# it. Past this the results are kept beside --out instead.
LOCK_WAIT_SECONDS = 30.0
PROG = "python -m modeling_diff.needle"

# The Python API's errors name its parameters; the command line's user typed these flags.
_FLAGS = {"num_needles": "--needles", "num_queries": "--queries", "trials": "--trials", "lengths": "--lengths",
          "depths": "--depths"}
_PARAMETER = re.compile(rf"(?<![-\w])({'|'.join(_FLAGS)})\b")


def _with_flag_names(error: Exception) -> str:
    """`error` (of `check_grid` or `evaluate_needles`) in one line, naming the flags instead of the parameters."""
    return _PARAMETER.sub(lambda match: _FLAGS[match.group(1)], " ".join(str(error).split()))


def _write_files(text: str, figure, directory: Path) -> None:
    (directory / "needle.json").write_text(text)
    figure.savefig(directory / "needle.png", dpi=120, bbox_inches="tight")


def _keep_results(staging: Path, out: Path) -> Path:
    """Where the results stay when they cannot be moved into --out: `staging` renamed beside it to a visible name
    after --out's (`results.needle-k3f9x2` for `results`), which no later run takes for a killed run's staging, or
    `staging` itself if even that rename fails. Returns the folder."""
    kept = staging.with_name(f"{out.name}.needle-{secrets.token_hex(4)}")
    try:
        staging.rename(kept)
        return kept
    except OSError:
        return staging


def _keep_elsewhere(text: str, figure, directory: Path, out: Path) -> Path:
    """The results written into a new visible folder in `directory` (named as `_keep_results` names it), for when
    they cannot be staged next to --out: its folder became a file, or another writer holds its lock."""
    kept = directory / f"{out.name}.needle-{secrets.token_hex(4)}"
    with atomic_directory(kept, name="the folder keeping the results") as staging:
        _write_files(text, figure, staging)
    return kept


def _write_results(result: NeedleResult, out: Path, written: list[Path]) -> str | None:
    """Write needle.json and needle.png into `out`: renamed as one folder to `out` if it does not exist, else file
    by file into it (it may hold other results, which are kept). Returns None, or when `out` could not take them,
    the error (the results then kept beside it, in a folder the error names). `written` gets each file written.

    Staged as `atomic_directory` stages (and under its lock for `out`, held for as long as the staging exists): a
    staging folder found under the lock is a killed run's (SIGKILL, the OOM killer) and is removed; one run's
    needle.json never lands beside another's needle.png. Ctrl-C and SIGTERM remove the staging (SIGTERM is raised
    as Ctrl-C for the whole run, by `main`) and wait until both files are renamed. A SIGKILL between those two
    renames cannot be prevented from leaving the new needle.json beside the old needle.png: only one folder renamed
    whole is atomic, and --out is a folder of other results too, which that would replace."""
    import matplotlib.pyplot as plt

    # Both rendered before anything is staged: the staging then lives for two file writes only, and a signal cannot
    # land in the import of matplotlib's renderer (a KeyboardInterrupt there became "ImportError: initialization
    # failed"). allow_nan=False: a NaN would make needle.json invalid JSON (evaluate_needles refuses NaN logits).
    text = json.dumps(result.to_dict(), indent=2, allow_nan=False)
    figure = plot_needle_heatmap(result).figure
    figure.canvas.draw()
    try:
        return _write_rendered(text, figure, out, written)
    finally:
        plt.close("all")


def _write_rendered(text: str, figure, out: Path, written: list[Path]) -> str | None:
    # Locked and staged next to the folder that --out names, through a link to one too (where atomic_directory
    # places them): every writer of that folder then takes the same lock, whichever name it was given.
    dst = out.resolve() if out.is_symlink() and out.is_dir() else out
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a folder above --out became a file while the evaluation ran
        kept = _keep_elsewhere(text, figure, next(p for p in dst.parents if p.is_dir()), out)
        return _no_longer_a_directory(out, kept)
    with contextlib.ExitStack() as stack:
        try:
            staging = stack.enter_context(locked_staging(dst, "--out", wait_seconds=LOCK_WAIT_SECONDS))
        except ValueError as error:
            kept = _keep_elsewhere(text, figure, dst.parent, out)
            return f"{' '.join(str(error).split())}; the results are kept in {str(kept)!r}"
        _write_files(text, figure, staging)
        staging.chmod(0o755)  # made private (0700); a new --out gets the mode of any folder made for output
        try:
            with signals_deferred():  # (a SIGKILL between the two renames cannot be deferred: see above)
                if dst.exists():
                    for name in RESULT_FILES:
                        (staging / name).replace(dst / name)
                        written.append(out / name)
                else:
                    staging.rename(dst)
                    written.extend(out / name for name in RESULT_FILES)
        except OSError as error:
            kept = _keep_results(staging, out)  # (`locked_staging` leaves a staging that still holds them)
            if any(p.exists() and not p.is_dir() for p in [out, *out.parents]):
                return _no_longer_a_directory(out, kept)
            return (f"--out {str(out)!r} could not take the results ({' '.join(str(error).split())}); the results "
                    f"are kept in {str(kept)!r}")
    return None


def _no_longer_a_directory(out: Path, kept: Path) -> str:
    blocker = next(p for p in [out, *out.parents] if p.exists() and not p.is_dir())
    return (f"--out {str(out)!r} is no longer a directory ({str(blocker)!r} became a file during the evaluation); "
            f"the results are kept in {str(kept)!r}")


def main(argv: list[str] | None = None) -> NeedleResult:
    written: list[Path] = []
    try:
        with sigterm_as_interrupt():  # SIGTERM unwinds as Ctrl-C does: the staging folder is removed
            return _main(argv, written)
    except KeyboardInterrupt:  # one line, no traceback; exit status 130 (as `modeling-diff convert`)
        what = (f"{' and '.join(str(p) for p in written)} had been written" if written else "nothing was written")
        print(f"{PROG}: interrupted; {what}", file=sys.stderr)
        raise SystemExit(130) from None


def _main(argv: list[str] | None, written: list[Path]) -> NeedleResult:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a local model directory (any causal LM with a tokenizer)")
    parser.add_argument("--gguf-file", help="a GGUF file inside the model directory")
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths (default: 1024, 2048, ... up to the model's maximum)")
    parser.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--needles", type=int, default=1, help="N, needles in each context")
    parser.add_argument("--queries", type=int, default=1, help="R, needles asked for in each context")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--haystack", type=Path, help="a text file (default: Hamlet)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="directory for needle.json and needle.png")
    args = parser.parse_args(argv)
    # Everything that can be refused without the model is refused before it loads.
    model_dir = Path(args.model)
    if not model_dir.is_dir():  # never taken for a Hub repository id: this command does not reach the network
        parser.error(f"model {args.model!r} is not a local directory")
    if args.gguf_file and not (model_dir / args.gguf_file).is_file():
        parser.error(f"--gguf-file {args.gguf_file!r} is not a file in {args.model!r}")
    try:  # transformers reads the config, index, tokenizer and generation config whole, and wherever a name leads
        check_side_files(model_dir, (*CONFIG_FILES, *SIDE_FILES))
    except ValueError as error:
        parser.error(" ".join(str(error).split()))
    if not args.gguf_file and not (model_dir / "config.json").is_file():
        parser.error(f"model {args.model!r} holds no config.json (a .gguf model needs --gguf-file)")
    odd = sorted(p.name for p in model_dir.iterdir() if not (p.is_file() or p.is_dir()))
    if odd:  # a FIFO shard would be waited on forever, a link to /dev/zero read without end
        parser.error(f"model {args.model!r} holds entries that are neither files nor folders (a FIFO, a device, a "
                     f"link to nothing): {', '.join(odd)}")
    try:  # and the weights wherever the names lead: another model's, linked or named out, would be evaluated
        check_weight_files(model_dir, args.gguf_file)
    except ValueError as error:
        parser.error(" ".join(str(error).split()))
    if args.out.is_symlink() and not args.out.exists():
        parser.error(f"--out {str(args.out)!r} is a link to nothing")
    blocker = next((p for p in [args.out, *args.out.parents] if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        parser.error(f"--out {str(args.out)!r} must be a directory; {str(blocker)!r} is a file")
    for name in RESULT_FILES:  # replaced one by one in an existing --out: each must be replaceable
        if (args.out / name).is_dir():
            parser.error(f"--out {str(args.out)!r} holds a directory {name}, where the result file goes")
    # The results are staged next to --out (and moved into it if it exists): both places must take a new entry.
    try:
        check_writable(args.out, "--out")
    except ValueError as error:
        parser.error(str(error))
    try:
        check_grid(args.lengths, args.depths, args.needles, args.queries, args.trials)
    except ValueError as error:
        parser.error(_with_flag_names(error))
    try:
        haystack = (read_text_file(args.haystack, "--haystack", max_bytes=MAX_HAYSTACK_BYTES)
                    if args.haystack else None)
    except ValueError as error:
        parser.error(" ".join(str(error).split()))

    matplotlib = require("matplotlib", f"{PROG} (it draws the heatmap)")
    if args.gguf_file:
        require("gguf", "--gguf-file")
        try:  # before transformers builds the model its metadata describes
            check_gguf(model_dir / args.gguf_file)
        except ValueError as error:
            parser.error(f"--gguf-file {error}")
    matplotlib.use("Agg")
    from transformers import AutoModelForCausalLM

    import modeling_diff  # noqa: F401  (registers the DiffLlama Auto classes)

    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    try:
        tokenizer = load_tokenizer(model_dir, **kwargs)
        model, info = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, **kwargs)
        check_loading_info(model_dir, info)  # a tensor missing would be evaluated at its random start
    except LOADING_ERRORS as error:  # a corrupt shard, a broken tokenizer, weights that are not the config's
        parser.error(f"model {args.model!r} could not be loaded: {' '.join(str(error).split())}")
    bad = first_non_finite(model)
    if bad is not None:  # refused before any cell runs
        parser.error(f"model {args.model!r} holds NaN or inf weights (first in tensor {bad!r}): its logits are not "
                     f"finite, so no needle can be scored; nothing was written")
    try:
        result = evaluate_needles(model, tokenizer, args.lengths, args.depths, args.needles, args.queries,
                                  args.trials, haystack, args.seed)
    except ValueError as error:  # what depends on the model (its context limit, refused before any cell runs; NaN
        parser.error(_with_flag_names(error))  # logits, as soon as a cell meets them)

    try:
        error = _write_results(result, args.out, written)
    except (OSError, ValueError) as failure:  # a full disk, a name too long: the summary at least is printed
        error = f"--out {str(args.out)!r}: the results could not be written: {' '.join(str(failure).split())}"
    print(result.summary())
    if error is not None:
        parser.error(error)
    print(f"wrote {args.out / 'needle.json'} and {args.out / 'needle.png'}")
    return result


if __name__ == "__main__":
    main()
