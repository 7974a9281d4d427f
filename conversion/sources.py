"""Read-only access to the tensors of a local safetensors checkpoint, one shard (or one tensor) at a time.

A checkpoint directory holds `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`). Only headers are read to list
and check tensors; tensor data is read when asked for, so memory stays near one shard.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointDir:
    """The safetensors files of checkpoint directory `path` and which tensor lives in which file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ValueError(f"source {str(self.path)!r} must be a directory with a config.json (or a .gguf file)")
        if (self.path / INDEX_FILE).is_file():
            try:
                weight_map = json.loads((self.path / INDEX_FILE).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{INDEX_FILE} in {self.path} must be JSON with a 'weight_map' object") from error
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
            raise ValueError(f"shard {file!r} listed in {INDEX_FILE} is missing from {self.path}")
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
