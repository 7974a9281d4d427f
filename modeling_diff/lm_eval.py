"""lm-evaluation-harness on DiffLlama checkpoints: `python -m modeling_diff.lm_eval ARGS` (or `modeling-diff eval ARGS`)
is `lm_eval ARGS` run in a Python where `import modeling_diff` has registered the Auto classes.

lm_eval's `hf` model loads `pretrained=DIR` through `AutoConfig` / `AutoModelForCausalLM`, which know model_type
"diff_llama" only after that import; a plain `lm_eval` process fails with "model type diff_llama ... not
recognized". Every argument is lm_eval's own (`--model hf --model_args pretrained=DIR --tasks ...`): this module
only registers the package and hands the command line to lm_eval's CLI. A folder written by `save_for_hub`
(`modeling-diff export`) needs neither: `lm_eval --model_args pretrained=DIR,trust_remote_code=True` loads its code.
"""

import sys

import modeling_diff  # noqa: F401  (registers the Auto classes, through which lm_eval's `hf` model loads)

from .extras import require


def main(argv: list[str] | None = None) -> None:
    """Run lm_eval's command line with `argv` (default: this process's arguments). lm_eval reads `sys.argv`
    itself, so it is set for the call and restored after it."""
    cli_evaluate = require("lm_eval.__main__", "modeling-diff eval").cli_evaluate
    argv = sys.argv[1:] if argv is None else list(argv)
    saved, sys.argv = sys.argv, ["lm-eval", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
