"""`modeling-diff convert SRC DST ...` (the converter), `modeling-diff eval ...` (lm-evaluation-harness) and
`modeling-diff export SRC DST` (a remote-code folder for the Hub): the command line."""

import argparse
import json
import sys
from pathlib import Path

from safetensors import SafetensorError

from modeling_diff.atomic import InterruptedAfterWriting, overwrite_from_flags
from modeling_diff.text_files import read_text_file

from . import diffllama, ecosystem
from .calibration import chooses_heads_by_entropy
from .convert import CHARS_PER_TOKEN_AT_MOST, convert_checkpoint


_HEADS_RULE = ("--heads must be 'entropy', 'all', comma-separated head indices or a JSON list of head indices or of "
               "lists of head indices (one per layer)")


def _heads(value: str):
    """`entropy`, `all`, `0,3,5` (every layer) or a JSON list of per-layer lists such as `[[0,1],[2]]`. A JSON list is
    a list of integers or of lists of integers (JSON true/false included, which `resolve_heads` names as booleans):
    anything nested deeper, or a string, number or object in place of an index, is refused here."""
    if value in ("entropy", "all"):
        return value
    try:
        heads = json.loads(value) if value.lstrip().startswith("[") else [int(h) for h in value.split(",")]
    except (ValueError, RecursionError) as error:
        raise argparse.ArgumentTypeError(f"{_HEADS_RULE}, got {value!r}") from error
    if not isinstance(heads, list) or not all(
            isinstance(item, int) or (isinstance(item, list) and all(isinstance(h, int) for h in item))
            for item in heads):
        raise argparse.ArgumentTypeError(f"{_HEADS_RULE}, got {value!r}")
    return heads


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modeling-diff", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert", help="retrofit a Llama / Mistral / Qwen2 checkpoint into a DiffLlama (same logits at conversion)",
        description="Convert SRC (a transformers directory with safetensors, single or sharded, or a .gguf file) "
        "into a DiffLlama checkpoint in DST. Sharded checkpoints are converted shard by shard. A transformers "
        "diffllama checkpoint converts to an exact V1; --to diffllama converts a V1 back.",
    )
    convert.add_argument("src", type=Path, help="source checkpoint directory or .gguf file (only read)")
    convert.add_argument("dst", type=Path, help="output directory (written to a temporary directory, then renamed)")
    convert.add_argument("--method", choices=("dex", "v2"), default=None,
                         help="dex: DEX operator on selected heads (default); v2: every head -> a signal/noise pair. "
                         "Not for a transformers diffllama source, which converts to an exact V1")
    convert.add_argument("--heads", type=_heads, default=None,
                         help="dex only: 'entropy' (default; on --calibration-file or the packaged text), 'all', "
                         "'0,3,5' or '[[0,1],[2],...]'")
    convert.add_argument("--head-fraction", type=float, default=None,
                         help="dex with entropy heads only: fraction of heads per layer selected by entropy (default "
                         "0.5, rounded up)")
    convert.add_argument("--calibration-file", type=Path,
                         help="text file for entropy head selection (first 512 tokens are used; default: the "
                         "packaged calibration.txt, the opening of Hamlet, public domain)")
    convert.add_argument("--anneal-steps", type=int, default=None,
                         help="T of the annealing schedule stored in the config (default 1000)")
    convert.add_argument("--noise-init", choices=("copy", "zeros"), default=None,
                         help="v2 only: the noise head starts as a copy of the signal head (default), or with zero "
                         "query weights")
    convert.add_argument("--overwrite", action="count", default=0,
                         help="replace DST if it holds a checkpoint (a config.json); twice: replace any directory")
    convert.add_argument("--quiet", action="store_true", help="no progress bars")
    convert.add_argument("--to", choices=diffllama.TARGETS, default=diffllama.TARGETS[0],
                         help="diff_llama: this package's model (default); diffllama: transformers' built-in "
                         "DiffLlama, from a V1 checkpoint (subln folded into o_proj; refused where not exact)")
    ecosystem.add_commands(commands)
    return parser


def _summary(dst: Path) -> str:
    config = json.loads((dst / "config.json").read_text())
    size = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    mode = config.get("diff_mode", f"v1 as transformers' {config['model_type']}")
    lines = [f"output     {dst}", f"method     {mode}",
             f"layers     {config['num_hidden_layers']} x {config['num_attention_heads']} heads "
             f"of {config['head_dim']}",
             *([f"anneal     T = {config['anneal_steps']} steps"] if mode in ("v2", "dex") else []),
             f"weights    {len(list(dst.glob('*.safetensors')))} file(s), {size / 2**20:.1f} MiB"]
    if config.get("dex_heads") is not None:
        selected = sum(len(layer) for layer in config["dex_heads"])
        total = config["num_hidden_layers"] * config["num_attention_heads"]
        per_layer = " ".join(",".join(map(str, heads)) for heads in config["dex_heads"])
        lines.append(f"DEX heads  {selected} of {total}: {per_layer}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except InterruptedAfterWriting as interrupt:  # taken while the output replaced DST: DST is the new output
        print(f"modeling-diff: interrupted; {str(interrupt.path)!r} had been written", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (which the writer raises as one): its output was removed
        print("modeling-diff: interrupted; nothing was written", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [ecosystem.EVAL]:  # lm_eval parses its own arguments
        return ecosystem.run_eval(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == ecosystem.EXPORT:
        try:
            print(ecosystem.run_export(args))
        except (ValueError, OSError, SafetensorError) as error:  # a refused input (a source without weights or
            parser.error(" ".join(str(error).split()))  # with a corrupt shard included), the disk; one line, exit 2
        return 0
    # Options that apply to one method only are refused elsewhere, as --heads is with v2: silently ignored, they
    # looked applied.
    if args.noise_init is not None and args.method != "v2":
        parser.error(f"--noise-init applies to --method v2 only (its noise heads), got --method {args.method or 'dex'}")
    for option, value in (("--head-fraction", args.head_fraction), ("--calibration-file", args.calibration_file)):
        if value is not None and not chooses_heads_by_entropy(args.method, args.heads):
            parser.error(f"{option} applies to --method dex with --heads entropy (the default) only, got --method "
                         f"{args.method or 'dex'} --heads {args.heads if args.heads is not None else 'entropy'}")
    calibration = None
    if args.calibration_file is not None:
        try:  # the opening only: what the first 512 tokens can take
            calibration = read_text_file(args.calibration_file, "--calibration-file",
                                         max_chars=512 * CHARS_PER_TOKEN_AT_MOST)
        except ValueError as error:
            parser.error(str(error))
    try:
        dst = convert_checkpoint(  # an option not given is None: a transformers diffllama source refuses any given
            args.src, args.dst, method=args.method, heads=args.heads, head_fraction=args.head_fraction,
            calibration=calibration, anneal_steps=args.anneal_steps, noise_init=args.noise_init,
            overwrite=overwrite_from_flags(args.overwrite), progress=not args.quiet, to=args.to,
        )
    except (ValueError, OSError, SafetensorError) as error:  # a refused input, or the disk (full, read-only)
        parser.error(" ".join(str(error).split()))  # one line; exits with status 2
    print(_summary(dst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
