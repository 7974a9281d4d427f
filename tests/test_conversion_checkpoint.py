"""Directory-to-directory conversion: single and sharded safetensors, streaming memory, atomic output, errors."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_conversion import tiny_llama, token_ids
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import modeling_diff.conversion.convert as convert_module
from modeling_diff import DiffLlamaForCausalLM
from modeling_diff.conversion import convert_checkpoint, convert_model

INDEX = "model.safetensors.index.json"


def save_source(model, path: Path, shard_size: str | None = None) -> Path:
    model.save_pretrained(path, **({"max_shard_size": shard_size} if shard_size else {}))
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}')  # carried over untouched
    return path


def fingerprint(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def sharded_source(tmp_path_factory):
    source = tiny_llama("qwen2")
    path = save_source(source, tmp_path_factory.mktemp("src") / "qwen2", shard_size="60KB")
    assert (path / INDEX).is_file() and len(list(path.glob("*.safetensors"))) > 3
    return source, path


@pytest.mark.parametrize("method", ["dex", "v2"])
def test_single_file_checkpoint(tmp_path, method):
    source, ids = tiny_llama("llama-mqa-tied-bias"), token_ids()
    src = save_source(source, tmp_path / "src")
    heads = "all" if method == "dex" else None
    dst = convert_checkpoint(src, tmp_path / "dst", method=method, heads=heads, anneal_steps=5, progress=False)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer_config.json"]
    converted = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert isinstance(converted, DiffLlamaForCausalLM) and converted.config.diff_mode == method
    with torch.no_grad():
        assert (converted(ids).logits - source(ids).logits).abs().max() <= 1e-4


def test_bfloat16_checkpoint_stays_bfloat16_in_every_parameter(tmp_path):
    source, ids = tiny_llama().to(torch.bfloat16), token_ids()
    src = save_source(source, tmp_path / "src")
    dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    saved = load_file(dst / "model.safetensors")
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert saved["model.layers.0.self_attn.dex_proj.weight"].dtype == torch.bfloat16
    assert saved["model.layers.0.self_attn.dex_lambda.lambda_learn"].dtype == torch.bfloat16  # one dtype (FSDP2)
    converted = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert converted.dtype == torch.bfloat16
    assert converted.model.layers[0].self_attn.dex_lambda.lambda_learn.shape == (1,)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, rtol=0, atol=1e-2)


@pytest.mark.parametrize("method", ["dex", "v2"])
def test_sharded_checkpoint_is_converted_shard_by_shard(tmp_path, sharded_source, method):
    source, src = sharded_source
    before, ids = fingerprint(src), token_ids()
    dst = convert_checkpoint(src, tmp_path / "dst", method=method, heads=[0, 2] if method == "dex" else None,
                             anneal_steps=5, progress=False)
    assert fingerprint(src) == before  # the source is only read

    index = json.loads((dst / INDEX).read_text())
    source_index = json.loads((src / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(source_index["weight_map"].values())  # one output shard per input
    for name, file in source_index["weight_map"].items():
        assert index["weight_map"][name] == file
    for layer in range(3):  # a layer's new tensors sit in the shard of its o_proj
        prefix = f"model.layers.{layer}.self_attn."
        assert index["weight_map"][prefix + "annealing.step"] == index["weight_map"][prefix + "o_proj.weight"]
    on_disk = {}
    for file in set(index["weight_map"].values()):
        on_disk.update({name: (file, t) for name, t in load_file(dst / file).items()})
    assert {name: file for name, (file, _) in on_disk.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in on_disk.values())

    converted = AutoModelForCausalLM.from_pretrained(dst).eval()
    with torch.no_grad():
        assert (converted(ids).logits - source(ids).logits).abs().max() <= 1e-4
    if method == "dex":
        assert converted.config.dex_heads == [[0, 2]] * 3


def test_entropy_heads_from_a_directory_match_the_in_memory_conversion(tmp_path, sharded_source):
    source, src = sharded_source
    ids = token_ids(length=16)
    dst = convert_checkpoint(src, tmp_path / "dst", calibration=ids, progress=False)
    in_memory = convert_model(source, calibration=ids, progress=False)
    assert json.loads((dst / "config.json").read_text())["dex_heads"] == in_memory.config.dex_heads


def test_existing_destination_needs_overwrite(tmp_path):
    src = save_source(tiny_llama(), tmp_path / "src")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="exists and is not empty; pass overwrite=True"):
        convert_checkpoint(src, dst, heads="all", progress=False)
    assert (dst / "keep.txt").read_text() == "precious"
    with pytest.raises(ValueError, match="holds no config.json, so it is not an earlier output"):
        convert_checkpoint(src, dst, heads="all", overwrite=True, progress=False)
    assert (dst / "keep.txt").read_text() == "precious"
    convert_checkpoint(src, dst, heads="all", overwrite="force", progress=False)
    assert not (dst / "keep.txt").exists() and (dst / "model.safetensors").is_file()
    convert_checkpoint(src, dst, heads=[1], overwrite=True, progress=False)  # an earlier output: one overwrite
    assert json.loads((dst / "config.json").read_text())["dex_heads"] == [[1]] * 3
    with pytest.raises(ValueError, match="must not be, contain or lie inside the source"):
        convert_checkpoint(src, src / "inside", heads="all", progress=False)
    with pytest.raises(ValueError, match="must not be, contain or lie inside the source"):
        convert_checkpoint(src, src, heads="all", overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no temporary directory left behind


def test_failure_midway_leaves_nothing_behind(tmp_path, sharded_source, monkeypatch):
    _, src = sharded_source
    written = []

    def failing_save_file(tensors, filename, metadata=None):
        if written:
            raise OSError("disk full")
        written.append(filename)
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(convert_module, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert written and list(tmp_path.iterdir()) == []


def _break_tensor(src: Path, name: str, replacement: torch.Tensor | None):
    """Rewrite the shard holding `name` with the tensor replaced (or removed)."""
    index = json.loads((src / INDEX).read_text())
    file = src / index["weight_map"][name]
    tensors = load_file(file)
    if replacement is None:
        del tensors[name]
    else:
        tensors[name] = replacement
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name,replacement,message",
    [
        ("model.layers.1.mlp.up_proj.weight", None, "'model.layers.1.mlp.up_proj.weight' is listed in .* but missing"),
        ("model.layers.2.self_attn.k_proj.weight", torch.zeros(7, 64),
         r"'model.layers.2.self_attn.k_proj.weight' in .* has shape \(7, 64\), expected \(32, 64\)"),
        ("model.norm.weight", torch.zeros(64, dtype=torch.int32), "'model.norm.weight' .* has dtype I32"),
    ],
)
def test_missing_or_malformed_tensors_are_named(tmp_path, name, replacement, message):
    src = save_source(tiny_llama(), tmp_path / "src", shard_size="60KB")
    _break_tensor(src, name, replacement)
    with pytest.raises(ValueError, match=message):
        convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert not (tmp_path / "dst").exists()


def test_tensor_missing_from_index_and_shard_is_named(tmp_path):
    src = save_source(tiny_llama(), tmp_path / "src", shard_size="60KB")
    name = "model.layers.0.self_attn.v_proj.weight"
    _break_tensor(src, name, None)
    index = json.loads((src / INDEX).read_text())
    del index["weight_map"][name]
    (src / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor '{name}' missing from"):
        convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)


def test_bad_source_directories(tmp_path):
    with pytest.raises(ValueError, match="must be a directory with a config.json"):
        convert_checkpoint(tmp_path / "nowhere", tmp_path / "dst", progress=False)
    src = save_source(tiny_llama(), tmp_path / "src", shard_size="60KB")
    index = json.loads((src / INDEX).read_text())
    missing_shard = sorted(set(index["weight_map"].values()))[1]
    (src / missing_shard).unlink()
    with pytest.raises(ValueError, match=f"shard '{missing_shard}' listed in {INDEX} is missing"):
        convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    (src / INDEX).write_text("not json")
    with pytest.raises(ValueError, match=f"{INDEX} in .* is not valid JSON"):
        convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)


def _resident_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def test_peak_memory_stays_near_one_shard(tmp_path):
    """16 shards of 8 MiB: the conversion's peak resident memory must stay far below the 128 MiB model."""
    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
    with torch.device("meta"):
        names = {name: t.shape for name, t in LlamaForCausalLM(config).state_dict().items()}
    src = tmp_path / "src"
    src.mkdir()
    config.save_pretrained(src)
    weight_map, generator = {}, torch.Generator().manual_seed(0)
    for layer in range(16):  # one shard per layer, written without ever holding the model
        shard = f"model-{layer:05d}.safetensors"
        tensors = {n: torch.randn(s, generator=generator) * 0.02 for n, s in names.items()
                   if n.startswith(f"model.layers.{layer}.") or (layer == 15 and not n.startswith("model.layers."))}
        save_file(tensors, src / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        del tensors
    (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    largest = max(p.stat().st_size for p in src.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in src.glob("*.safetensors"))

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set size (VmHWM) of this process
    baseline = _resident_kib("VmRSS")
    convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    peak = (_resident_kib("VmHWM") - baseline) * 1024
    print(f"peak memory of the conversion: {peak / 2**20:.1f} MiB; largest shard {largest / 2**20:.1f} MiB, "
          f"model {total / 2**20:.1f} MiB")
    assert peak < 4 * largest < total / 3
    assert sum(p.stat().st_size for p in (tmp_path / "dst").glob("*.safetensors")) > total  # all of it was written
