"""`modeling-diff convert SRC DST --method dex ...`: the converter on the command line."""

import argparse
import json
import sys
from pathlib import Path

from .convert import DEFAULT_ANNEAL_STEPS, convert_checkpoint


def _heads(value: str):
    """`entropy`, `all`, `0,3,5` (every layer) or a JSON list of per-layer lists such as `[[0,1],[2]]`."""
    if value in ("entropy", "all"):
        return value
    try:
        return json.loads(value) if value.lstrip().startswith("[") else [int(h) for h in value.split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"--heads must be 'entropy', 'all', comma-separated head indices or a JSON list of lists, got {value!r}"
        ) from error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modeling-diff", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert", help="retrofit a Llama / Mistral / Qwen2 checkpoint into a DiffLlama (same logits at conversion)",
        description="Convert SRC (a transformers directory with safetensors, single or sharded, or a .gguf file) "
        "into a DiffLlama checkpoint in DST. Sharded checkpoints are converted shard by shard.",
    )
    convert.add_argument("src", type=Path, help="source checkpoint directory or .gguf file (only read)")
    convert.add_argument("dst", type=Path, help="output directory (written to a temporary directory, then renamed)")
    convert.add_argument("--method", choices=("dex", "v2"), default="dex",
                         help="dex: DEX operator on selected heads (default); v2: every head -> a signal/noise pair")
    convert.add_argument("--heads", type=_heads, default=None,
                         help="dex only: 'entropy' (default; needs --calibration-file), 'all', '0,3,5' "
                         "or '[[0,1],[2],...]'")
    convert.add_argument("--head-fraction", type=float, default=0.5,
                         help="fraction of heads per layer selected by entropy (default 0.5, rounded up)")
    convert.add_argument("--calibration-file", type=Path,
                         help="text file for entropy head selection (first 512 tokens are used)")
    convert.add_argument("--anneal-steps", type=int, default=None,
                         help="T of the annealing schedule stored in the config (default 1000)")
    convert.add_argument("--noise-init", choices=("copy", "zeros"), default="copy",
                         help="v2 only: the noise head starts as a copy of the signal head, or with zero query weights")
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    convert.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _summary(dst: Path) -> str:
    config = json.loads((dst / "config.json").read_text())
    size = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
    lines = [f"output     {dst}", f"method     {config['diff_mode']}",
             f"layers     {config['num_hidden_layers']} x {config['num_attention_heads']} heads "
             f"of {config['head_dim']}",
             f"anneal     T = {config['anneal_steps']} steps",
             f"weights    {len(list(dst.glob('*.safetensors')))} file(s), {size / 2**20:.1f} MiB"]
    if config.get("dex_heads") is not None:
        selected = sum(len(layer) for layer in config["dex_heads"])
        total = config["num_hidden_layers"] * config["num_attention_heads"]
        per_layer = " ".join(",".join(map(str, heads)) for heads in config["dex_heads"])
        lines.append(f"DEX heads  {selected} of {total}: {per_layer}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.calibration_file is not None and not args.calibration_file.is_file():
        parser.error(f"--calibration-file {str(args.calibration_file)!r} is not a file")
    calibration = args.calibration_file.read_text() if args.calibration_file is not None else None
    try:
        dst = convert_checkpoint(
            args.src, args.dst, method=args.method, heads=args.heads, head_fraction=args.head_fraction,
            calibration=calibration,
            anneal_steps=DEFAULT_ANNEAL_STEPS if args.anneal_steps is None else args.anneal_steps,
            noise_init=args.noise_init, overwrite=args.overwrite, progress=not args.quiet,
        )
    except ValueError as error:
        parser.error(str(error))  # exits with status 2
    print(_summary(dst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
