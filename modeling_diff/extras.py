"""Optional dependencies, imported where they are used, with an error naming the extra that installs them:
`[peft]` (peft: `modeling_diff.lora`), `[gguf]` (gguf: reading .gguf files, `load_smollm2`), `[needle]`
(matplotlib: `plot_needle_heatmap`, the diagnostics plots, `python -m modeling_diff.needle`), `[eval]` (lm-eval:
`modeling-diff eval`)."""

import importlib
import importlib.util

# top-level module -> the extra installing it
EXTRAS = {"peft": "peft", "gguf": "gguf", "matplotlib": "needle", "lm_eval": "eval"}


def require(module: str, purpose: str):
    """`importlib.import_module(module)`, or a ModuleNotFoundError saying `purpose` needs it and which extra
    installs it (`module`'s top-level package must be one of EXTRAS)."""
    top_level = module.partition(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if importlib.util.find_spec(top_level) is not None:
            raise  # the package is there, but a module it needs is not: its own error says which
        raise ModuleNotFoundError(
            f"{purpose} needs the {top_level!r} package: pip install 'modeling-diff[{EXTRAS[top_level]}]'",
            name=top_level,
        ) from error


__all__ = ["EXTRAS", "require"]
