"""Read-only access to the tensors of a local safetensors checkpoint, one shard (or one tensor) at a time.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`). Only headers are read to list
and check tensors; tensor data is read when asked for, so memory stays near one shard.

Every file name read from the checkpoint (the shards of the index) must be a plain `.safetensors` file name,
and every file must lie inside the checkpoint: a crafted index cannot make the converter read or write elsewhere.
"Inside" is the checkpoint directory itself or, for a snapshot of the Hugging Face cache
(`models--org--name/snapshots/<revision>/`, whose files are links to `models--org--name/blobs/`), that repository's
cache folder.
"""

import json
import os
import stat
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


# The files transformers' AutoTokenizer reads from a checkpoint directory.
TOKENIZER_READS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
# ... and every file from_pretrained and AutoTokenizer read besides config.json, index and weights.
SIDE_FILES = (*TOKENIZER_READS, "generation_config.json")

# transformers (and this package) read a config, an index, a tokenizer or a generation config whole. The largest of
# real checkpoints are far smaller: an index of thousands of tensors takes a few MiB, Gemma 3's tokenizer.json about 33 MB.
MAX_WHOLE_READ_BYTES = 64 * 2**20


def check_utf8_path(path: Path, name: str) -> None:
    """A checkpoint's path (source or output) must be valid UTF-8: safetensors opens, and tokenizers writes, UTF-8
    paths only. A name the shell passed as other bytes failed deep inside them ("surrogates not allowed", or a shard
    "not valid UTF-8"), after the work was done, or left an output that no one could load."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} {os.fsencode(path)!r} is not valid UTF-8: safetensors and tokenizers, which read "
                         f"and write checkpoints, take UTF-8 paths only; use a UTF-8 name") from None


def check_whole_read(path: Path) -> None:
    """Before `path` is read whole: a ValueError naming it unless it is a regular file of at most MAX_WHOLE_READ_BYTES.
    A link to /dev/zero or a FIFO would be read forever, a file of gigabytes would end in a MemoryError (deep inside
    transformers, for the files it reads)."""
    try:
        info = path.stat()
    except OSError as error:
        raise ValueError(f"{path.name} in {str(path.parent)!r} cannot be read: {error}") from error
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_WHOLE_READ_BYTES:
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"{info.st_size} bytes"
        raise ValueError(f"{path.name} in {str(path.parent)!r} must be a regular file of at most "
                         f"{MAX_WHOLE_READ_BYTES} bytes (it is read whole), got {what}")


def check_side_files(path: Path, names: tuple[str, ...] = SIDE_FILES) -> None:
    """Before transformers reads the files `names` of checkpoint `path` (its tokenizer, its generation config): each
    that is there must be a file inside the checkpoint that `check_whole_read` admits. A link leading out
    (`tokenizer.json -> /etc/passwd`, or another model's tokenizer) would be read as this checkpoint's."""
    root = checkpoint_root(path)
    for name in names:
        file = path / name
        if not (file.exists() or file.is_symlink()):
            continue
        if not is_inside(file, root):
            raise ValueError(f"{name} in {str(path)!r} is a link to {str(file.resolve())!r}, outside the checkpoint "
                             f"{str(root)!r}: refusing to read it as the checkpoint's")
        check_whole_read(file)


def read_json_object(path: Path) -> dict:
    """The JSON object in file `path`; a ValueError naming the file for anything else (garbage, empty, `null`), and
    before reading it for what `check_whole_read` refuses."""
    check_whole_read(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path.name} in {str(path.parent)!r} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} in {str(path.parent)!r} must hold a JSON object, got {json.dumps(value)[:40]}")
    return value


def _check_shard_name(file, tensor) -> None:
    if (not isinstance(file, str) or not file.endswith(".safetensors") or file != Path(file).name
            or "\\" in file or "\0" in file or file.startswith(".")):
        raise ValueError(f"{INDEX_FILE}: the shard of tensor {tensor!r} must be a plain .safetensors file name "
                         f"inside the checkpoint (no directory, no '..', not hidden), got {file!r}")


class CheckpointDir:
    """The safetensors files of checkpoint directory `path` and which tensor lives in which file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ValueError(f"source {str(self.path)!r} must be a directory with a config.json (or a .gguf file)")
        check_utf8_path(self.path, "source")
        self.root = checkpoint_root(self.path)
        self.config = read_json_object(self.path / "config.json")
        if (self.path / INDEX_FILE).is_file():
            weight_map = read_json_object(self.path / INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{INDEX_FILE} in {self.path} must be JSON with a 'weight_map' object "
                                 f"(tensor name -> shard file), got {type(weight_map).__name__}")
            for tensor, file in weight_map.items():
                _check_shard_name(file, tensor)
            self.files = list(dict.fromkeys(weight_map.values()))  # shard order of first appearance
        elif (self.path / SINGLE_FILE).is_file():
            self.files = [SINGLE_FILE]
        else:
            raise ValueError(f"source {str(self.path)!r} must hold {SINGLE_FILE} or {INDEX_FILE} (only safetensors)")
        self.is_sharded = self.files != [SINGLE_FILE]
        # name -> file, from the shard headers themselves, so an index naming a tensor its shard lacks is caught.
        self.weight_map: dict[str, str] = {}
        for file in self.files:
            for name in self._header_names(file):
                if name in self.weight_map:
                    raise ValueError(f"tensor {name!r} appears in both {self.weight_map[name]} and {file}")
                self.weight_map[name] = file
        if self.is_sharded:
            listed_only = sorted(set(weight_map) - set(self.weight_map))
            if listed_only:
                raise ValueError(f"tensor {listed_only[0]!r} is listed in {INDEX_FILE} but missing from its shard "
                                 f"{weight_map[listed_only[0]]}")

    def _open(self, file: str):
        if not (self.path / file).is_file():
            there = (self.path / file).exists() or (self.path / file).is_symlink()
            what = "is not a regular file (a FIFO, a device, a link to nothing) in" if there else "is missing from"
            raise ValueError(f"shard {file!r} listed in {INDEX_FILE} {what} {self.path}")
        if not is_inside(self.path / file, self.root):
            raise ValueError(f"shard {file!r} in {self.path} is a link to {str((self.path / file).resolve())!r}, "
                             f"outside the checkpoint {str(self.root)!r}")
        try:
            return safe_open(self.path / file, framework="pt")
        except Exception as error:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"shard {file!r} in {self.path} is not a readable safetensors file: {error}") from error

    def _header_names(self, file: str) -> list[str]:
        with self._open(file) as handle:
            return list(handle.keys())

    def headers(self, file: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, safetensors dtype string) for every tensor of `file`, from its header alone."""
        with self._open(file) as handle:
            return {name: (tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype())
                    for name in handle.keys()}

    def read_shard(self, file: str) -> dict[str, torch.Tensor]:
        with self._open(file) as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ValueError(f"tensor {name!r} missing from {self.path}")
        with self._open(self.weight_map[name]) as handle:
            return handle.get_tensor(name)
