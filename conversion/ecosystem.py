"""`modeling-diff eval ...` (lm-evaluation-harness with the package registered) and `modeling-diff export SRC DST`
(a checkpoint -> a self-contained remote-code folder, `modeling_diff.hub.save_for_hub`)."""

import argparse
from pathlib import Path

EVAL = "eval"
EXPORT = "export"


def add_commands(commands) -> None:
    """Add `eval` and `export` to the subparsers `commands` of the `modeling-diff` parser."""
    commands.add_parser(
        EVAL, add_help=False, help="lm-evaluation-harness's CLI with the package's Auto classes registered",
        description="modeling-diff eval ARGS = lm_eval ARGS with `import modeling_diff` done first, e.g. "
        "`modeling-diff eval --model hf --model_args pretrained=DIR --tasks hellaswag`. Every argument is lm_eval's "
        "(`modeling-diff eval --help` prints its help). Needs pip install 'modeling-diff[eval]'.",
    )
    export = commands.add_parser(
        EXPORT, help="write a DiffLlama checkpoint as a self-contained remote-code folder (for the Hub)",
        description="Load the DiffLlama checkpoint SRC and write DST with save_for_hub: weights, config with "
        "auto_map, the model code as flat files, a model card and SRC's tokenizer. DST then loads with "
        "AutoModelForCausalLM.from_pretrained(DST, trust_remote_code=True) without modeling_diff installed; "
        "upload it with `hf upload REPO DST` (huggingface_hub's CLI) or modeling_diff.hub.push_to_hub.",
    )
    export.add_argument("src", type=Path, help="DiffLlama checkpoint directory (only read)")
    export.add_argument("dst", type=Path, help="output folder (written to a temporary directory, then renamed); "
                        "not SRC, inside it or containing it")
    export.add_argument("--repo-id", help="the Hub repository id (name or namespace/name) named in the model card")
    export.add_argument("--overwrite", action="count", default=0,
                        help="replace DST if it holds an earlier output (a config.json); twice: replace any directory")


def run_eval(argv: list[str]) -> int:
    """`modeling-diff eval ARGS`: lm_eval's own command line, which parses ARGS (so they bypass argparse here)."""
    from modeling_diff.lm_eval import main

    main(argv)
    return 0


def run_export(args: argparse.Namespace) -> str:
    """`modeling-diff export SRC DST`; returns the summary to print. ValueError for every refused input (a --repo-id
    that is no Hub repository id, a source that is not ours or that holds a PEFT adapter, a DST that is SRC or inside
    it, or not an earlier output without --overwrite twice) checked before the model loads; for a model or tokenizer
    that does not load, and for weights that are not exactly the model's (a tensor missing, unexpected or of another
    shape), after."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    from modeling_diff.atomic import check_destination, overwrite_from_flags
    from modeling_diff.checkpoint_files import (LOADING_ERRORS, check_loading_info, check_side_files,
                                                check_weight_files, load_tokenizer)
    from modeling_diff.configuration import DiffLlamaConfig
    from modeling_diff.hub import check_repo_id, save_for_hub

    from .sources import CheckpointDir

    if args.repo_id is not None:  # pasted into the model card's title and loading snippet
        check_repo_id(args.repo_id, "--repo-id")

    # The converter's checks of a source (its config, index and shards: regular files inside it), read once; and
    # every weight file from_pretrained could read (a model.safetensors beside an index, leading out, is loaded)
    source = CheckpointDir(args.src)
    check_weight_files(args.src)
    overwrite = overwrite_from_flags(args.overwrite)
    protect = (args.src, source.root)  # a Hub cache snapshot's blobs are its repository folder's
    check_destination(args.dst, overwrite, protect, name="dst", expected=("config.json",))
    model_type = source.config.get("model_type")
    if model_type != DiffLlamaConfig.model_type:
        raise ValueError(f"src must be a {DiffLlamaConfig.model_type!r} checkpoint (convert a Llama first with "
                         f"`modeling-diff convert`), got model_type {model_type!r} in {str(args.src / 'config.json')}")
    check_side_files(args.src)  # the tokenizer and generation config transformers reads whole, inside SRC
    has_tokenizer = any((args.src / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its load report: the refusal below names what it would list
    try:  # the tokenizer first: it loads in a moment (whatever it raises is a ValueError naming its files)
        tokenizer = load_tokenizer(args.src) if has_tokenizer else None
        try:
            model, info = AutoModelForCausalLM.from_pretrained(args.src, dtype="auto", local_files_only=True,
                                                               output_loading_info=True, ignore_mismatched_sizes=True)
        except LOADING_ERRORS as error:  # what broken files raise inside transformers, a corrupt shard's included
            raise ValueError(f"src {str(args.src)!r} could not be loaded: {type(error).__name__}: {error}") from error
    finally:
        transformers_logging.set_verbosity(verbosity)
    check_loading_info(args.src, info)  # a missing tensor was exported as random weights, with exit status 0
    dst = save_for_hub(model, args.dst, tokenizer=tokenizer, repo_id=args.repo_id, overwrite=overwrite,
                       protect=protect)
    files = sorted(path.name for path in dst.iterdir())
    return "\n".join([
        f"output     {dst}",
        f"model      {model.config.diff_mode}, {model.num_parameters():,} parameters",
        f"tokenizer  {'carried' if tokenizer is not None else 'none in src'}",
        f"files      {' '.join(files)}",
        f"load with  AutoModelForCausalLM.from_pretrained({str(dst)!r}, trust_remote_code=True)",
    ])


__all__ = ["EVAL", "EXPORT", "add_commands", "run_eval", "run_export"]
