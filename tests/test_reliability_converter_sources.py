"""The converter's promises about its sources, attacked through the command line: a GGUF source is checked as a
folder is (its tensors, the files read beside it, its config, the Hub cache folder it lies in) before it is
dequantised or DST is touched; an unreplaceable earlier output, an index of SRC's and a tokenizer_config.json that
cannot be rewritten are each refused (or left out) up front."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import unwritable
from ecosystem_helpers import byte_tokenizer
from test_conversion import tiny_llama
from test_reliability_conversion import _sparse, cli_error, hidden_leftovers, tree_hash
from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_diff.conversion.convert as convert_module
from modeling_diff.conversion.cli import main

# A complete tiny GGUF Llama: 2 layers, 4 heads over 2 kv heads, hidden 32, an 8-token tokenizer.
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 8, 32, 64, 2, 4, 2


def _gguf_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def random(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    kv = KV_HEADS * HIDDEN // HEADS
    tensors = {"token_embd.weight": random(VOCAB, HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32),
               "output.weight": random(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        tensors.update({f"blk.{i}.attn_norm.weight": np.ones(HIDDEN, np.float32),
                        f"blk.{i}.attn_q.weight": random(HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": random(kv, HIDDEN),
                        f"blk.{i}.attn_v.weight": random(kv, HIDDEN),
                        f"blk.{i}.attn_output.weight": random(HIDDEN, HIDDEN),
                        f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, np.float32),
                        f"blk.{i}.ffn_gate.weight": random(INTERMEDIATE, HIDDEN),
                        f"blk.{i}.ffn_up.weight": random(INTERMEDIATE, HIDDEN),
                        f"blk.{i}.ffn_down.weight": random(HIDDEN, INTERMEDIATE)})
    return tensors


def write_gguf(path: Path, skip: tuple[str, ...] = (), rope_freq_base: float | None = None) -> Path:
    """A complete tiny Llama as a GGUF file at `path`, without the tensors `skip`; `rope_freq_base` in its metadata."""
    from gguf import GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(LAYERS)
    for key, value in dict(context_length=64, embedding_length=HIDDEN, feed_forward_length=INTERMEDIATE,
                           head_count=HEADS, head_count_kv=KV_HEADS, layer_norm_rms_eps=1e-6).items():
        getattr(writer, f"add_{key}")(value)
    if rope_freq_base is not None:
        writer.add_rope_freq_base(rope_freq_base)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i) for i in range(VOCAB)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_bos_token_id(VOCAB - 1)
    for name, array in _gguf_tensors().items():
        if name not in skip:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def never_dequantised(monkeypatch):
    """The refusals must come before the model is dequantised and before DST (its lock, its staging) is touched."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("dequantised, or DST touched, before the source was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(convert_module, "atomic_directory", refuse)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A sharded tiny Llama checkpoint with a byte-level tokenizer; tests convert copies of it."""
    path = tmp_path_factory.mktemp("pristine") / "llama"
    tiny_llama().save_pretrained(path, max_shard_size="100KB")
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def src(pristine, tmp_path):
    return Path(shutil.copytree(pristine, tmp_path / "src"))


# ----------------------------------------------------------------------------------------------------------
# 1. A GGUF file missing a tensor.
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip,named", [
    (("blk.1.ffn_down.weight",), "'model.layers.1.mlp.down_proj.weight' (blk.1.ffn_down.weight)"),
    (("output_norm.weight",), "'model.norm.weight' (output_norm.weight)"),
    (("blk.0.attn_q.weight", "blk.1.attn_q.weight"),
     "'model.layers.0.self_attn.q_proj.weight' (blk.0.attn_q.weight), "
     "'model.layers.1.self_attn.q_proj.weight' (blk.1.attn_q.weight)"),
])
def test_a_gguf_file_missing_a_tensor_is_refused_naming_it_before_it_is_dequantised(tmp_path, capsys,
                                                                                    never_dequantised, skip, named):
    """transformers loads such a file with the tensor left at its random start (it only prints a report): the random
    weights were converted with exit status 0, two conversions of one file giving two models."""
    gguf = write_gguf(tmp_path / "gguf" / "model.gguf", skip=skip)
    line = cli_error(["convert", str(gguf), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert f"tensor {named} missing from the GGUF file {str(gguf)!r}" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf"]


def test_a_complete_gguf_file_converts_to_the_logits_transformers_loads(tmp_path, capsys):
    """The check of its tensors refuses none of a complete file (and DST beside the file is no part of the source).
    `--quiet` shows no progress bar, transformers' own included (dequantising, loading, writing: three were shown)."""
    gguf = write_gguf(tmp_path / "model.gguf")
    assert main(["convert", str(gguf), str(tmp_path / "dst"), "--heads", "all", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    source = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        converted = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()(ids).logits
        assert (converted - source(ids).logits).abs().max() <= 1e-4


# ----------------------------------------------------------------------------------------------------------
# 4. The files AutoTokenizer reads next to a .gguf file.
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model",
                                  "special_tokens_map.json"])
@pytest.mark.parametrize("attack", ["link out", "gigabytes"])
def test_tokenizer_files_next_to_a_gguf_file_are_checked_before_they_are_read(tmp_path, capsys, monkeypatch,
                                                                              never_dequantised, name, attack):
    """With gguf_file, AutoTokenizer also reads the files its tokenizer class names (a tokenizer.json there is loaded
    instead of the .gguf's tokenizer): one linking to another model's was carried into DST as the source's, and a
    sparse one of 3 GiB was read whole. Both refused by name, before the tokenizer is read or DST touched."""
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("the tokenizer was read"))
    gguf = write_gguf(tmp_path / "gguf" / "model.gguf")
    if attack == "link out":
        other = tmp_path / "other" / name
        other.parent.mkdir()
        other.write_text("{}")
        (gguf.parent / name).symlink_to(other)
        message = f"{name} in {str(gguf.parent)!r} leads to {str(other)!r}, outside the checkpoint"
    else:
        _sparse(gguf.parent / name)
        message = f"{name} in {str(gguf.parent)!r} must be a regular file of at most 67108864 bytes"
    line = cli_error(["convert", str(gguf), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert message in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["gguf", *(["other"] if attack == "link out" else [])])


# ----------------------------------------------------------------------------------------------------------
# 5. A .gguf file in a Hub cache snapshot: its repository folder is the source's.
# ----------------------------------------------------------------------------------------------------------


def _cached_gguf(tmp_path: Path) -> tuple[Path, Path]:
    """(repository folder, snapshot file): `models--o--n/snapshots/rev1/model.gguf -> ../../blobs/<sha>`, with
    refs/main and a second snapshot rev0 linking to the same blob."""
    repo = tmp_path / "hub" / "models--o--n"
    write_gguf(repo / "blobs" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("rev1")
    for revision in ("rev0", "rev1"):
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "snapshots" / revision / "model.gguf").symlink_to("../../blobs/abc123")
    return repo, repo / "snapshots" / "rev1" / "model.gguf"


@pytest.mark.parametrize("where,flags", [
    ("snapshots/rev1/converted", []),
    ("refs", ["--overwrite", "--overwrite"]),  # would delete refs/main
    ("snapshots/rev0", ["--overwrite", "--overwrite"]),  # would replace another snapshot
])
def test_a_gguf_file_in_a_hub_cache_snapshot_protects_its_repository_folder(tmp_path, capsys, never_dequantised,
                                                                            where, flags):
    """README: DST may not lie in a snapshot's repository folder. For a .gguf SRC the folder was looked for from the
    file resolved (blobs/<sha>, where no snapshot shows): DST inside the snapshot was written, and refs/ or another
    snapshot replaced with --overwrite twice."""
    repo, gguf = _cached_gguf(tmp_path)
    before = tree_hash(repo)
    line = cli_error(["convert", str(gguf), str(repo / where), "--heads", "all", *flags], capsys)
    assert f"must not be, contain or lie inside the source {str(repo)!r}" in line, line
    assert tree_hash(repo) == before and hidden_leftovers(repo / Path(where).parent) == []


# ----------------------------------------------------------------------------------------------------------
# 6. An earlier output that cannot be replaced.
# ----------------------------------------------------------------------------------------------------------


def test_an_immutable_earlier_output_is_refused_before_the_calibration(src, tmp_path, capsys, monkeypatch):
    """With --overwrite, an immutable (chattr +i) earlier output was refused only by the final rename: after the
    calibration and the whole conversion. Now tried with the destination's other checks, before either."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "config.json").write_text("{}")  # an earlier output
    before = tree_hash(dst)

    def refuse(*args, **kwargs):
        raise AssertionError("calibrated or staged before the destination was found unwritable")

    monkeypatch.setattr(convert_module, "atomic_directory", refuse)
    monkeypatch.setattr(convert_module, "attention_entropy", refuse)
    with unwritable(dst):
        line = cli_error(["convert", str(src), str(dst), "--overwrite"], capsys)  # heads by entropy: a calibration
    assert f"destination {str(dst)!r} cannot be written" in line, line
    assert tree_hash(dst) == before and hidden_leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------------------
# 7. A GGUF source's bad inputs, refused before it is dequantised.
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,rope_freq_base,message", [
    (["--heads", "all", "--anneal-steps", str(2**40)], None,
     f"anneal_steps must be an integer >= 0 and < 2**31 (the config's bound), got {2**40}"),
    (["--method", "v2", "--anneal-steps", str(2**31)], None, f"< 2**31 (the config's bound), got {2**31}"),
    (["--heads", "all"], 0.5, "rope_parameters['rope_theta'] must be >= 1 and finite, got 0.5"),  # rope_freq_base
])
def test_a_gguf_source_s_bad_anneal_steps_or_metadata_are_refused_before_it_is_dequantised(
        tmp_path, capsys, never_dequantised, argv, rope_freq_base, message):
    """The output's DiffLlamaConfig refused them, but was built only after dequantising, beside DST's lock and
    staging."""
    gguf = write_gguf(tmp_path / "gguf" / "model.gguf", rope_freq_base=rope_freq_base)
    line = cli_error(["convert", str(gguf), str(tmp_path / "dst"), *argv], capsys)
    assert message in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf"]


def test_anneal_steps_beyond_the_config_s_bound_are_refused_before_a_folder_source_is_read(src, tmp_path, capsys,
                                                                                        monkeypatch):
    monkeypatch.setattr(convert_module, "CheckpointDir", lambda *a, **k: pytest.fail("the source was read"))
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all", "--anneal-steps", str(2**31)],
                     capsys)
    assert f"anneal_steps must be an integer >= 0 and < 2**31 (the config's bound), got {2**31}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ----------------------------------------------------------------------------------------------------------
# 8. No index of SRC's is copied, whatever its format.
# ----------------------------------------------------------------------------------------------------------


def test_no_index_of_the_source_is_carried_into_the_output(src, tmp_path, capsys):
    """A stale pytorch_model.bin.index.json beside the safetensors (which transformers loads) was copied into DST,
    naming shards DST does not hold (`export` of DST then refused them)."""
    stale = {"metadata": {}, "weight_map": {"model.norm.weight": "../shared/pytorch_model-00001-of-00001.bin"}}
    indexes = ["pytorch_model.bin.index.json", "tf_model.h5.index.json", "flax_model.msgpack.index.json"]
    for name in indexes:
        (src / name).write_text(json.dumps(stale))
    assert main(["convert", str(src), str(tmp_path / "dst"), "--heads", "all", "--quiet"]) == 0
    held = {p.name for p in (tmp_path / "dst").iterdir()}
    assert not held & set(indexes), held
    assert "model.safetensors.index.json" in held  # DST's own index, written by the converter


# ----------------------------------------------------------------------------------------------------------
# 9. A tokenizer_config.json that must be rewritten but cannot be written as UTF-8.
# ----------------------------------------------------------------------------------------------------------


def test_a_tokenizer_config_with_a_lone_surrogate_to_rewrite_is_refused_up_front_naming_it(src, tmp_path, capsys,
                                                                                          monkeypatch):
    """A fast_tokenizer_files entry leading out of SRC makes the converter rewrite tokenizer_config.json; a string in
    it holding the JSON escape of a lone surrogate ("\\udc80", which Python reads) cannot be written as UTF-8: it
    failed after the whole conversion, naming no file."""
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["fast_tokenizer_files"] = ["../other/tokenizer.4.0.json"]
    (src / "tokenizer_config.json").write_text(json.dumps(config)[:-1] + ', "comment": "\\udc80"}')
    monkeypatch.setattr(convert_module, "atomic_directory",
                        lambda *a, **k: pytest.fail("DST touched before tokenizer_config.json was checked"))
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert f"tokenizer_config.json in {str(src)!r} must be rewritten" in line and "lone surrogate" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ----------------------------------------------------------------------------------------------------------
# A full disk while the tokenizer is written (convert from a .gguf file, export).
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_full_disk_while_the_tokenizer_is_written_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch,
                                                                                  command):
    """The tokenizers library raises a bare Exception for the disk's errors, which went past the one-line errors
    (a traceback, exit status 1). A .gguf file's tokenizer is written from its metadata, export's from SRC's."""
    from transformers import PreTrainedTokenizerBase

    src = write_gguf(tmp_path / "gguf" / "model.gguf")
    if command == "export":  # a converted model (with the file's tokenizer) to export
        assert main(["convert", str(src), str(tmp_path / "converted"), "--heads", "all", "--quiet"]) == 0
        src = tmp_path / "converted"

    def full(self, save_directory, *args, **kwargs):
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    before = tree_hash(tmp_path)
    argv = [command, str(src), str(tmp_path / "dst"), *(["--heads", "all"] if command == "convert" else [])]
    with pytest.raises(SystemExit) as exit_info:  # (transformers' progress bars on stderr too)
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if ": error: " in line]
    assert "the tokenizer could not be written" in line and "No space left on device" in line, line
    assert tree_hash(tmp_path) == before
