"""Read-only access to the tensors of a local safetensors checkpoint, one shard (or one tensor) at a time.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`). The weights read are those
transformers' `from_pretrained` loads: the file config.json names in `transformers_weights`, else
`model.safetensors`, else the index's shards (a folder holding both a model.safetensors and an index loads the
former). Only headers are read to list and check tensors; tensor data is read when asked for, so memory stays
near one shard.

Every file name read from the checkpoint (the shards of the index) must be a plain `.safetensors` file name,
and every file must lie inside the checkpoint (`modeling_diff.checkpoint_files.checkpoint_root`): a crafted index
cannot make the converter read or write elsewhere.
"""

import re
from pathlib import Path

import torch
from safetensors import safe_open

from modeling_diff.atomic import check_utf8_path
from modeling_diff.checkpoint_files import (CONFIG_FILES, INDEX_FILE, check_layer_count, check_no_adapter,
                                            check_side_files, checkpoint_root, is_inside, read_checkpoint_json)

SINGLE_FILE = "model.safetensors"
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\..+")


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
        check_side_files(self.path, CONFIG_FILES)  # another model's config or index, linked, is not this one's
        check_no_adapter(self.path)  # from_pretrained would apply it: the source is not these weights alone
        self.config = read_checkpoint_json(self.path, "config.json")
        self.index, single = self._weights_loaded()
        self.is_sharded = self.index is not None
        if self.is_sharded:
            weight_map = read_checkpoint_json(self.path, self.index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{self.index} in {self.path} must be JSON with a 'weight_map' object "
                                 f"(tensor name -> shard file), got {type(weight_map).__name__}")
            for tensor, file in weight_map.items():
                _check_shard_name(file, tensor)
            self.files = list(dict.fromkeys(weight_map.values()))  # shard order of first appearance
        else:
            self.files = [single]
        # name -> file, from the shard headers themselves, so an index naming a tensor its shard lacks is caught.
        self.weight_map: dict[str, str] = {}
        self._renames: dict[str, str] = {}  # a tensor's name here -> the name from_pretrained loads it as
        for file in self.files:
            for name in self._header_names(file):
                if name in self.weight_map:
                    raise ValueError(f"tensor {name!r} appears in both {self.weight_map[name]} and {file}")
                self.weight_map[name] = file
        if self.is_sharded:
            listed_only = sorted(set(weight_map) - set(self.weight_map))
            if listed_only:
                raise ValueError(f"tensor {listed_only[0]!r} is listed in {self.index} but missing from its shard "
                                 f"{weight_map[listed_only[0]]}")
        self._check_layers()

    def _weights_loaded(self) -> tuple[str | None, str | None]:
        """(index, None) or (None, single file): the weights `from_pretrained` loads from this folder, in its order
        (transformers 5: config.json's `transformers_weights`, `model.safetensors`, the index). Read in another
        order, a folder holding both a model.safetensors and an index converted the index's shards while
        transformers loads model.safetensors as the source."""
        explicit = self.config.get("transformers_weights")
        if explicit is not None:
            if (not isinstance(explicit, str) or not explicit.endswith((".safetensors", ".safetensors.index.json"))
                    or explicit != Path(explicit).name or explicit.startswith(".") or "\\" in explicit
                    or "\0" in explicit):
                raise ValueError(f"config.json in {str(self.path)!r}: transformers_weights must be the plain name of "
                                 f"a .safetensors file or a .safetensors.index.json in the checkpoint folder (no "
                                 f"directory, not hidden), got {explicit!r}")
            if explicit.endswith(".json"):  # read whole, like the standard index (`read_checkpoint_json`)
                return explicit, None
            return None, explicit
        if (self.path / SINGLE_FILE).is_file():
            return None, SINGLE_FILE
        if (self.path / INDEX_FILE).is_file():
            return INDEX_FILE, None
        raise ValueError(f"source {str(self.path)!r} must hold {SINGLE_FILE} or {INDEX_FILE} (only safetensors)")

    def _check_layers(self) -> None:
        """config.json's num_hidden_layers against the layers of the shard headers (`model.layers.<i>.`), before
        any config or model is built from it (also for `export`)."""
        held = {int(match.group(1)) for match in map(_LAYER_TENSOR.fullmatch, self.weight_map) if match}
        check_layer_count(self.config.get("num_hidden_layers"), held, f"config.json in {str(self.path)!r}",
                          "num_hidden_layers", "model.layers.{}")

    def _open(self, file: str):
        if not (self.path / file).is_file():
            there = (self.path / file).exists() or (self.path / file).is_symlink()
            what = "is not a regular file (a FIFO, a device, a link to nothing) in" if there else "is missing from"
            listed = f"shard {file!r} listed in {self.index}" if self.index else f"weight file {file!r}"
            raise ValueError(f"{listed} {what} {self.path}")
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

    def load_as(self, renames: dict[str, str]) -> None:
        """From now on, tensor `stored` of the checkpoint is read as `renames[stored]`, the name from_pretrained loads
        it as (`mapping.tied_renames`), by every method below and in `weight_map`."""
        self._renames = dict(renames)
        self.weight_map = {renames.get(name, name): file for name, file in self.weight_map.items()}

    def _loaded(self, handle) -> dict[str, str]:
        """name as loaded -> name stored, for every tensor of the open file `handle`."""
        return {self._renames.get(name, name): name for name in handle.keys()}

    def headers(self, file: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """name -> (shape, safetensors dtype string) for every tensor of `file`, from its header alone."""
        with self._open(file) as handle:
            return {name: (tuple(handle.get_slice(stored).get_shape()), handle.get_slice(stored).get_dtype())
                    for name, stored in self._loaded(handle).items()}

    def read_shard(self, file: str) -> dict[str, torch.Tensor]:
        with self._open(file) as handle:
            return {name: handle.get_tensor(stored) for name, stored in self._loaded(handle).items()}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ValueError(f"tensor {name!r} missing from {self.path}")
        with self._open(self.weight_map[name]) as handle:
            return handle.get_tensor(self._loaded(handle)[name])
