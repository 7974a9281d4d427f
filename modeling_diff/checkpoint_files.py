"""The rules for the files transformers reads from a checkpoint folder besides its weights, and for its path.

transformers reads a config, a tokenizer and a generation config whole, and reads whatever a file name leads to.
Before it does, every such file of the folder must lie inside the checkpoint (a link, or a name with `..`, leading
out would be read as the checkpoint's) and be a regular file of at most MAX_WHOLE_READ_BYTES (a FIFO would be
waited on, a sparse file of gigabytes ended in a MemoryError inside transformers). "Inside" is the checkpoint
folder itself or, for a snapshot of the Hugging Face cache (`models--org--name/snapshots/<revision>/`, whose files
are links to `models--org--name/blobs/`), that repository's cache folder. (A checkpoint's path must also be valid
UTF-8: `modeling_diff.atomic.check_utf8_path`.) A JSON file of a checkpoint is read through `read_checkpoint_json`,
which applies these rules first. A folder holding a PEFT adapter, which from_pretrained applies on top of the weights,
is refused where a checkpoint is converted or exported (`check_no_adapter`).

One module for the converter (`modeling_diff.conversion`), the needle evaluation, the Hub export and LoRA: the
model package does not import the converter.
"""

import fnmatch
import json
import re
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# What transformers' AutoTokenizer reads from a checkpoint folder, as patterns (a folder, then an fnmatch pattern of
# names in it): tokenizer.json, tokenizer_config.json and the versioned tokenizer.<version>.json of
# `fast_tokenizer_files`; tokenizer.model, spm.model or another SentencePiece (or tiktoken) model, which it finds by
# the suffix; the vocabularies of BPE and WordPiece tokenizers; the chat templates, the named ones in their folder.
TOKENIZER_READS = ("tokenizer*.json", "special_tokens_map.json", "added_tokens.json", "*.model", "tekken.json",
                   "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
                   f"{CHAT_TEMPLATE_DIR}/*.jinja")
# ... and every file from_pretrained and AutoTokenizer read besides config.json, index and weights.
SIDE_FILES = (*TOKENIZER_READS, "generation_config.json")
# The files from_pretrained reads whole before the weights: the config and the index of a sharded checkpoint.
INDEX_FILE = "model.safetensors.index.json"
PT_INDEX_FILE = "pytorch_model.bin.index.json"
CONFIG_FILES = ("config.json", INDEX_FILE, PT_INDEX_FILE)
# The weights from_pretrained reads from a local folder (without `variant`): one file, or the shards of an index.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")

# A PEFT adapter saved into a model's folder: from_pretrained(folder) applies it (`check_no_adapter`).
ADAPTER_CONFIG = "adapter_config.json"

# What loading a checkpoint that passed these rules may still raise from inside transformers, for broken contents:
# besides OSError and ValueError, a corrupt shard's SafetensorError, a tokenizer_config.json mapping an id to a
# number a TypeError, a field of the wrong kind an AttributeError or a KeyError. Loaders report them in one line.
LOADING_ERRORS = (OSError, ValueError, RuntimeError, SafetensorError, TypeError, KeyError, AttributeError)

# transformers (and this package) read a config, an index, a tokenizer or a generation config whole. The largest of
# real checkpoints are far smaller: an index of thousands of tensors takes a few MiB, Gemma 3's tokenizer.json about 33 MB.
MAX_WHOLE_READ_BYTES = 64 * 2**20


# Elements checked at a time for NaN and inf: the mask of a whole embedding would take as many bytes as it has
# elements (a shard-sized peak the streaming conversion does not otherwise have).
_FINITE_CHUNK = 2**20


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is finite, checked in chunks (no mask of its whole size)."""
    flat = tensor.detach().reshape(-1)
    return all(bool(torch.isfinite(flat[start:start + _FINITE_CHUNK]).all())
               for start in range(0, flat.numel(), _FINITE_CHUNK))


def first_non_finite(model: torch.nn.Module) -> str | None:
    """The name of the first tensor of `model`'s state dict holding NaN or inf, or None. Such a model's logits are NaN:
    trained, evaluated or saved, it gave NaN everywhere without a word (a needle mean of 0.000, NaN weights saved)."""
    return next((name for name, tensor in model.state_dict().items() if not is_finite(tensor)), None)


def checkpoint_root(path: Path) -> Path:
    """The folder every file of checkpoint `path` must resolve into: the repository folder of a Hub cache snapshot
    (`models--*/snapshots/<revision>` -> `models--*`, which holds the blobs), else `path` itself."""
    try:
        path = path.resolve()
    except (OSError, RuntimeError):  # a loop of links: the checks that read the checkpoint say so
        return path
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith(("models--", "datasets--")):
        return path.parent.parent
    return path


def is_inside(path: Path, root: Path) -> bool:
    """Whether `path`, with every link followed, lies inside `root` (already resolved)."""
    target = path.resolve()
    return target == root or root in target.parents


def check_whole_read(path: Path) -> None:
    """Before `path` is read whole: a ValueError naming it unless it is a regular file of at most MAX_WHOLE_READ_BYTES
    that reports a size. A link to /dev/zero or a FIFO would be read forever, a file of gigabytes would end in a
    MemoryError (deep inside transformers, for the files it reads), and the files of /proc report a size of 0 and may
    block when read (/proc/kmsg hung the converter), as `modeling_diff.text_files.read_text_file` refuses them."""
    try:
        info = path.stat()
    except OSError as error:
        raise ValueError(f"{path.name} in {str(path.parent)!r} cannot be read: {error}") from error
    if not stat.S_ISREG(info.st_mode) or not 0 < info.st_size <= MAX_WHOLE_READ_BYTES:
        what = ("not a regular file" if not stat.S_ISREG(info.st_mode)
                else "an empty file, or one that reports no size (such as those of /proc), which is not read"
                if info.st_size == 0 else f"{info.st_size} bytes")
        raise ValueError(f"{path.name} in {str(path.parent)!r} must be a regular file of at most "
                         f"{MAX_WHOLE_READ_BYTES} bytes (it is read whole), got {what}")


def read_json_object(path: Path) -> dict:
    """The JSON object in file `path`; a ValueError naming the file for anything else (garbage, `null`), and before
    reading it for what `check_whole_read` refuses. A file of a checkpoint is read with `read_checkpoint_json`."""
    check_whole_read(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path.name} in {str(path.parent)!r} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} in {str(path.parent)!r} must hold a JSON object, got {json.dumps(value)[:40]}")
    return value


def read_checkpoint_json(path: Path, name: str) -> dict:
    """The JSON object in file `name` of checkpoint `path` (its config.json, an index, its tokenizer_config.json), read
    only if it lies inside the checkpoint and `check_whole_read` admits it: the one rule for every such read (a
    config.json linking to /proc/kmsg, or to another model's config, was read before it was checked)."""
    _check_side_file(path, name, checkpoint_root(path))
    return read_json_object(path / name)


def check_no_adapter(path: Path) -> None:
    """Before checkpoint `path` (a folder, or the folder of a .gguf file) is converted or exported: a ValueError unless
    it holds no PEFT adapter. from_pretrained(path) finds ADAPTER_CONFIG (as `PeftModel.save_pretrained(path)` leaves
    it, next to adapter_model.safetensors) and applies the adapter on top of the weights: the conversion of the
    weights alone had other logits than the source, and carried adapter_config.json without the adapter's weights
    into an output that did not load. The entry is never read (it may lead anywhere)."""
    if (path / ADAPTER_CONFIG).exists() or (path / ADAPTER_CONFIG).is_symlink():
        raise ValueError(f"{str(path)!r} holds a PEFT adapter ({ADAPTER_CONFIG}), which from_pretrained applies on top "
                         f"of the model's weights: merge it into the model first (PeftModel's merge_and_unload(), "
                         f"then save_pretrained to a new folder) and use that folder, or remove the adapter's files to "
                         f"use the base model alone")


def side_files(path: Path, patterns: tuple[str, ...] = SIDE_FILES) -> list[Path]:
    """The entries of checkpoint `path` that `patterns` match, whatever they are (a FIFO, a link to nothing): a
    pattern is a folder inside `path` (or none), then an fnmatch pattern of the names in it."""
    found = {}
    for pattern in patterns:
        folder, _, names = pattern.rpartition("/")
        if (path / folder).is_dir():
            found.update(dict.fromkeys(entry for entry in sorted((path / folder).iterdir())
                                       if fnmatch.fnmatchcase(entry.name, names)))
    return list(found)


def load_tokenizer(path: str | Path, purpose: str = "", local_files_only: bool = True, **kwargs):
    """`AutoTokenizer.from_pretrained(path, local_files_only=..., **kwargs)`, a checkpoint's files checked by the
    caller first; whatever it raises is a ValueError naming `path`, the tokenizer's files there and `purpose`: the
    tokenizers library raises a bare Exception for a tokenizer.json it rejects, a GGUF file without tokenizer metadata
    is a KeyError (tracebacks, in `convert`, `export`, the needle evaluation and examples/train.py, which all load a
    tokenizer through this). No code of the checkpoint's runs (`trust_remote_code=False`): transformers has no
    tokenizer class of its own for DiffLlamaConfig, so an `auto_map` in tokenizer_config.json made it offer to run the
    folder's Python and run it on a "y"."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=local_files_only, trust_remote_code=False, **kwargs)
    except Exception as error:  # tokenizers fail in many ways (missing sentencepiece, a broken file, ...)
        path = Path(path)
        files = kwargs.get("gguf_file") or (", ".join(str(file.relative_to(path))
                                                      for file in side_files(path, TOKENIZER_READS))
                                            if path.is_dir() else "")  # (not a folder: a Hub id, train.py's)
        raise ValueError(f"the tokenizer in {str(path)!r}{f' ({files})' if files else ''} could not be "
                         f"loaded{purpose}: {type(error).__name__}: {error}") from error


def fast_tokenizer_files(path: Path) -> list[str]:
    """The versioned tokenizer files the tokenizer_config.json of `path` names: transformers reads the one for its
    version, by a name relative to `path` that may lead anywhere (`../other/tokenizer.4.0.json`)."""
    names = read_checkpoint_json(path, TOKENIZER_CONFIG).get("fast_tokenizer_files", [])
    if not isinstance(names, list) or not all(isinstance(name, str) and "\0" not in name for name in names):
        raise ValueError(f"{TOKENIZER_CONFIG} in {str(path)!r}: fast_tokenizer_files must be a list of file names, "
                         f"got {json.dumps(names)[:40]}")
    return names


def check_side_files(path: Path, patterns: tuple[str, ...] = SIDE_FILES) -> None:
    """Before transformers reads the files `patterns` match in checkpoint `path` (its tokenizer, its generation config;
    with CONFIG_FILES its config and index) and the versioned tokenizer files its tokenizer_config.json names: each
    that is there must be a file inside the checkpoint that `check_whole_read` admits. A link leading out
    (`tokenizer.json -> /etc/passwd`, or another model's tokenizer or config) would be read as this checkpoint's."""
    root = checkpoint_root(path)
    files = side_files(path, patterns)
    for file in files:
        _check_side_file(path, str(file.relative_to(path)), root)
    if path / TOKENIZER_CONFIG in files:
        for name in fast_tokenizer_files(path):
            if (path / name).exists() or (path / name).is_symlink():
                _check_side_file(path, name, root)


def check_loading_info(path: Path, info: dict) -> None:
    """After `from_pretrained(path, output_loading_info=True, ignore_mismatched_sizes=True)` (so that a shape other
    than the config's is reported in `info`, not raised): a ValueError naming the checkpoint and the tensors unless
    its weights are exactly the model's. transformers only prints a report, and the model would be evaluated, trained
    or exported as the checkpoint with a missing tensor at its random start, an unexpected one dropped, one of
    another shape re-initialized."""
    def names(keys, limit: int) -> str:
        keys = sorted(keys)
        return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")

    problems = []
    if info["missing_keys"]:
        problems.append(f"tensors missing in its weights: {names(info['missing_keys'], 5)} (they would start at "
                        f"random)")
    if info["unexpected_keys"]:
        problems.append(f"tensors unexpected in its weights: {names(info['unexpected_keys'], 5)} (no part of the "
                        f"model, they would be dropped)")
    if info["mismatched_keys"]:
        shapes = {f"{key} {list(ckpt)} in the checkpoint, {list(model)} by the config"
                  for key, ckpt, model in info["mismatched_keys"]}
        problems.append(f"tensors of shapes other than the config's: {names(shapes, 3)}")
    if problems:
        raise ValueError(f"{str(path)!r} does not hold the weights its config describes: {'; '.join(problems)}")


def check_layer_count(layers, held: set[int], where: str, field: str, tensor: str) -> None:
    """A checkpoint's layer count `layers` (its `field`) must be the number of layers its tensors hold, numbered from
    0 (`held`, the numbers in its tensor names `tensor.format(i)`), compared before any model is built from it: a
    count of a million made transformers build a million layers (minutes, tens of GiB) before the tensors were
    compared with them. (A tensor of layer 999999 does not make a million layers.) A count that is no number is left
    to transformers' config check."""
    if isinstance(layers, bool) or not isinstance(layers, (int, float)):
        return
    numbered = held == set(range(len(held)))
    if layers == len(held) and numbered:
        return
    count = f"{len(held)} layer{'' if len(held) == 1 else 's'}"
    if not held:
        what = f"0 layers (no {tensor.format('<i>')} tensor)"
    elif numbered:
        what = f"{count} ({tensor.format(0)} to {tensor.format(len(held) - 1)})"
    else:  # the first number missing lies within len(held) (a layer numbered 10**12 builds no set of that size)
        gap = next(i for i in range(len(held) + 1) if i not in held)
        what = f"{count}, numbered up to {max(held)} (no {tensor.format(gap)}.* tensor)"
    raise ValueError(f"{where}: {field} is {layers}, but its tensors hold {what}; {field} must be the number of "
                     f"layers of the checkpoint, numbered from 0")


_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\..+")


def check_gguf(path: Path) -> None:
    """Before transformers loads the GGUF file `path` (which it dequantizes into a model whose config comes from the
    file's metadata): a ValueError naming it unless gguf's own reader parses it (a truncated file, or one that is not
    GGUF, was a traceback from deep inside the reader) and its `<architecture>.block_count` is the number of layers
    its tensors hold (`blk.<i>.*`)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        architecture = reader.fields["general.architecture"].contents()
    except Exception as error:  # the reader's own on malformed bytes: struct.error, ValueError, IndexError, ...
        raise ValueError(f"{str(path)!r} is not a readable GGUF file ({type(error).__name__}: {error})") from None
    count = reader.fields.get(f"{architecture}.block_count")
    held = {int(match.group(1)) for match in (_GGUF_LAYER_TENSOR.fullmatch(t.name) for t in reader.tensors) if match}
    if count is not None:
        check_layer_count(count.contents(), held, f"GGUF file {str(path)!r}", f"{architecture}.block_count",
                          "blk.{}")


def weight_files(path: Path, gguf_file: str | None = None) -> list[str]:
    """The names, relative to checkpoint `path`, of the weight files from_pretrained would read: `gguf_file`, or
    those of WEIGHT_FILES that are there, the file config.json names in `transformers_weights` (which from_pretrained
    loads instead, checking only its name) and the shards the indexes there name (checked whole first)."""
    if gguf_file is not None:
        return [gguf_file]
    names = [name for name in WEIGHT_FILES if (path / name).exists() or (path / name).is_symlink()]
    indexes = [INDEX_FILE, PT_INDEX_FILE]
    explicit = read_checkpoint_json(path, "config.json").get("transformers_weights") \
        if (path / "config.json").exists() else None
    if explicit is not None:
        if not isinstance(explicit, str) or "\0" in explicit:
            raise ValueError(f"config.json in {str(path)!r}: transformers_weights must be a file name, got "
                             f"{json.dumps(explicit)[:40]}")
        _check_inside(path, explicit, checkpoint_root(path))  # before it is read as an index
        names.append(explicit)
        if explicit.endswith(".json"):
            indexes.append(explicit)
    for index in dict.fromkeys(indexes):
        if (path / index).exists() or (path / index).is_symlink():
            weight_map = read_checkpoint_json(path, index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(name, str) and "\0" not in name
                                                           for name in weight_map.values()):
                raise ValueError(f"{index} in {str(path)!r} must hold a 'weight_map' object of tensor name -> shard "
                                 f"file name, got {json.dumps(weight_map)[:40]}")
            names.extend(dict.fromkeys(weight_map.values()))
    return names


def check_weight_files(path: Path, gguf_file: str | None = None) -> None:
    """Before from_pretrained loads checkpoint `path` (with `gguf_file`, that file of it): every weight file it would
    read lies inside the checkpoint and is a regular file where it is there (a missing one transformers reports). A
    shard or .gguf leading out (`model.safetensors -> ../other/model.safetensors`, `--gguf-file ../x.gguf`) would be
    loaded as this checkpoint's weights; a FIFO would be waited on forever."""
    root = checkpoint_root(path)
    for name in weight_files(path, gguf_file):
        _check_inside(path, name, root)
        if (path / name).exists() and not (path / name).is_file():
            raise ValueError(f"{name} in {str(path)!r} must be a regular file, got a FIFO, a device or a folder")


def _check_side_file(path: Path, name: str, root: Path) -> None:
    _check_inside(path, name, root)
    check_whole_read(path / name)


def _check_inside(path: Path, name: str, root: Path) -> None:
    if not is_inside(path / name, root):
        raise ValueError(f"{name} in {str(path)!r} leads to {str((path / name).resolve())!r}, outside the checkpoint "
                         f"{str(root)!r}: refusing to read it as the checkpoint's")
