"""The needle evaluation, `diagnose` and the Hub model card, attacked (issue 14, items 9 and 10): bad arguments are
refused before the model loads, with one line and exit status 2; nothing reaches the network; models with learned
positions work at their default lengths; no staging directory is left; the model's train/eval mode survives an
exception."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from ecosystem_helpers import byte_tokenizer, tiny_config, write_gguf_header
from test_needle import HAYSTACK
from test_reliability_conversion import plant_code, tree_hash
from transformers import GPT2Config, GPT2LMHeadModel

import modeling_diff.needle as needle
from modeling_diff import DiffLlamaForCausalLM
from modeling_diff import diagnostics as D
from modeling_diff.hub import model_card


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("needle") / "model"
    torch.manual_seed(0)
    DiffLlamaForCausalLM(tiny_config("v2", max_position_embeddings=512)).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def needle_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        needle.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if ": error: " in line]  # (after argparse's usage lines)
    assert len(errors) == 1, err
    return errors[0]


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--depths", "1.5"], "depths must be a non-empty list of fractions in [0, 1]"),
        (["--depths", "nan"], "depths must be"),
        (["--needles", "2", "--queries", "3"], "--queries must be in [1, --needles=2]"),
        (["--needles", "99"], "--needles must be in [1, 30]"),
        (["--trials", "0"], "trials must be >= 1"),
        (["--lengths", "0", "256"], "lengths must be a non-empty list of positive integers"),
        (["--gguf-file", "model.gguf"], "--gguf-file 'model.gguf' is not a file"),
    ],
)
def test_bad_needle_arguments_are_refused_before_the_model_loads(model_dir, tmp_path, capsys, no_model_loading,
                                                                 extra, message):
    line = needle_error([str(model_dir), "--out", str(tmp_path / "out"), *extra], capsys)
    assert message in line
    assert list(tmp_path.iterdir()) == []


def test_needle_paths_are_checked_first(model_dir, tmp_path, capsys, no_model_loading):
    # A mistyped path is not taken for a Hub repository id (which would try the network).
    assert "model 'org/no-such-model' is not a local directory" in needle_error(
        ["org/no-such-model", "--out", str(tmp_path / "out")], capsys)
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "out"):
        assert "must be a directory" in needle_error([str(model_dir), "--out", str(out)], capsys)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    line = needle_error([str(model_dir), "--out", str(tmp_path / "out"), "--haystack", str(tmp_path / "latin1.txt")],
                        capsys)
    assert "utf-8" in line.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "latin1.txt"]


def test_needle_refuses_an_out_it_cannot_write_and_a_model_without_config_before_loading(
        model_dir, tmp_path, capsys, no_model_loading):
    # /proc takes no new directory, for root too (whom permission bits do not stop): found before the model loads,
    # not after every cell has run
    for out in ("/proc/modeling-diff-needle", "/proc/modeling-diff-needle/results"):
        assert "cannot be written" in needle_error([str(model_dir), "--out", out], capsys)
    (tmp_path / "empty").mkdir()
    line = needle_error([str(tmp_path / "empty"), "--out", str(tmp_path / "out")], capsys)
    assert "holds no config.json" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    # a link to nothing as --out, and a directory where a result file goes: found before, not after, the run
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert "is a link to nothing" in needle_error([str(model_dir), "--out", str(tmp_path / "dangling")], capsys)
    (tmp_path / "out" / "needle.json").mkdir(parents=True)
    line = needle_error([str(model_dir), "--out", str(tmp_path / "out")], capsys)
    assert "holds a directory needle.json" in line


def test_needle_refuses_a_model_folder_with_a_fifo_and_a_corrupt_shard_in_one_line(model_dir, tmp_path, capsys):
    """A FIFO shard hung the needle evaluation forever; a corrupt one ended in a SafetensorError traceback."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")
    line = needle_error([str(model), "--out", str(tmp_path / "out")], capsys)
    assert "neither files nor folders" in line and "model.safetensors" in line
    (model / "model.safetensors").unlink()
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert "could not be loaded" in needle_error([str(model), "--out", str(tmp_path / "out")], capsys)
    assert not (tmp_path / "out").exists()


# What transformers reads whole from a model folder besides config and weights: named, versioned, by suffix, in a folder
SIDE_FILES = ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.4.0.0.json", "spm.model", "additional_chat_templates/tool_use.jinja"]


def plant_side_file(model: Path, name: str, kind: str) -> None:
    """`model/name` as a sparse file of 3 GiB (no disk used), a FIFO, or a link leading out of `model`; a versioned
    tokenizer file is named in tokenizer_config.json's `fast_tokenizer_files`, as transformers finds it."""
    if name.startswith("tokenizer.4"):
        config = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps({**config, "fast_tokenizer_files": [name]}))
    (model / name).parent.mkdir(exist_ok=True)
    (model / name).unlink(missing_ok=True)
    if kind == "3 GiB":
        with open(model / name, "wb") as file:
            file.truncate(3 << 30)
    elif kind == "FIFO":
        os.mkfifo(model / name)
    else:
        (model.parent / "elsewhere").write_text("{}")
        (model / name).symlink_to(model.parent / "elsewhere")


def assert_side_file_refused(line: str, model: Path, name: str, kind: str) -> None:
    """One line naming the file and the rule."""
    where = f"{Path(name).name} in {str((model / name).parent)!r}"
    if kind == "link out":
        assert f"{name} in {str(model)!r} leads to" in line and "outside the checkpoint" in line, line
    else:
        assert f"{where} must be a regular file of at most 67108864 bytes" in line, line
        assert ("got not a regular file" if kind == "FIFO" else f"got {3 << 30} bytes") in line, line


@pytest.mark.parametrize("kind", ["3 GiB", "FIFO", "link out"])
@pytest.mark.parametrize("name", SIDE_FILES)
def test_needle_refuses_a_side_file_transformers_would_read_whole_or_outside_the_folder(
        model_dir, tmp_path, capsys, no_model_loading, name, kind):
    """The needle evaluation loaded the folder's tokenizer and generation config unchecked: a sparse 3 GiB one ends
    in a MemoryError, a FIFO is waited on, a link leading out is read as the model's. Refused before loading."""
    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    plant_side_file(model, name, kind)
    line = needle_error([str(model), "--out", str(tmp_path / "out")], capsys)
    assert_side_file_refused(line, model, name, kind)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["3 GiB", "FIFO", "link out"])
def test_needle_refuses_a_config_json_transformers_would_read_whole_or_outside_the_folder(
        model_dir, tmp_path, capsys, no_model_loading, kind):
    """The needle evaluation loaded config.json unchecked: a sparse 3 GiB one would end in a MemoryError, a FIFO was
    refused as a missing config, a link leading out (another model's config) was read as the model's."""
    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    plant_side_file(model, "config.json", kind)
    line = needle_error([str(model), "--out", str(tmp_path / "out")], capsys)
    assert_side_file_refused(line, model, "config.json", kind)
    assert not (tmp_path / "out").exists()


def test_needle_refuses_a_versioned_tokenizer_named_outside_the_folder(model_dir, tmp_path, capsys, no_model_loading):
    """transformers reads the `fast_tokenizer_files` entry for its version by a name relative to the folder, `..`
    included: it read another folder's tokenizer as this model's."""
    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    (tmp_path / "other").mkdir()
    shutil.copy(model / "tokenizer.json", tmp_path / "other" / "tokenizer.4.0.0.json")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["fast_tokenizer_files"] = ["../other/tokenizer.4.0.0.json"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    line = needle_error([str(model), "--out", str(tmp_path / "out")], capsys)
    assert f"../other/tokenizer.4.0.0.json in {str(model)!r} leads to" in line and "outside the checkpoint" in line


@pytest.mark.parametrize("attack", ["link out", "shard link out", "shard named ..", "shard a FIFO in a folder",
                                    "gguf named ..", "gguf absolute"])
def test_needle_refuses_weights_outside_the_folder_or_not_a_file(model_dir, tmp_path, capsys, no_model_loading,
                                                                 attack):
    """The needle evaluation loaded whatever weights the folder's names led to: a model.safetensors, a shard of the
    index or a --gguf-file linking or named out of the folder was evaluated as this model (another model's weights);
    a FIFO shard was waited on forever. Refused before loading, as the converter refuses its shards."""
    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    other = tmp_path / "other"
    other.mkdir()
    (model / "model.safetensors").rename(other / "model.safetensors")
    extra, name = [], {"link out": "model.safetensors", "shard link out": "model-00001-of-00001.safetensors",
                       "shard named ..": "../other/model.safetensors",
                       "shard a FIFO in a folder": "shards/model-00001-of-00001.safetensors",
                       "gguf named ..": "../other/model.gguf", "gguf absolute": str(other / "model.gguf")}[attack]
    if attack.startswith("shard"):
        with safe_open(other / "model.safetensors", framework="pt") as weights:
            index = {"metadata": {}, "weight_map": dict.fromkeys(weights.keys(), name)}
        (model / "model.safetensors.index.json").write_text(json.dumps(index))
    if attack in ("link out", "shard link out"):
        (model / name).symlink_to(other / "model.safetensors")
    elif attack == "shard a FIFO in a folder":
        (model / "shards").mkdir()
        os.mkfifo(model / name)
    elif attack.startswith("gguf"):
        (model / "model.safetensors").symlink_to(other / "model.safetensors")
        (other / "model.gguf").write_bytes(b"GGUF")
        extra = ["--gguf-file", name]
    line = needle_error([str(model), "--out", str(tmp_path / "out"), *extra], capsys)
    if attack == "shard a FIFO in a folder":
        assert f"{name} in {str(model)!r} must be a regular file, got a FIFO" in line, line
    else:
        assert f"{name} in {str(model)!r} leads to" in line and "outside the checkpoint" in line, line
    assert not (tmp_path / "out").exists()


def test_lengths_beyond_the_model_are_one_line(model_dir, tmp_path, capsys):
    line = needle_error([str(model_dir), "--out", str(tmp_path / "out"), "--lengths", "4096"], capsys)
    assert "lengths must not exceed max_position_embeddings (512)" in line
    assert list(tmp_path.iterdir()) == []


def test_a_failure_while_writing_results_leaves_no_staging(model_dir, tmp_path, monkeypatch):
    def broken_plot(result):
        raise RuntimeError("matplotlib failed")

    monkeypatch.setattr(needle, "plot_needle_heatmap", broken_plot)
    (tmp_path / "haystack.txt").write_text(HAYSTACK)
    with pytest.raises(RuntimeError, match="matplotlib failed"):
        needle.main([str(model_dir), "--lengths", "256", "--depths", "0.5", "--haystack", str(tmp_path / "haystack.txt"),
                     "--out", str(tmp_path / "out")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["haystack.txt"]


def test_default_lengths_fit_a_model_with_learned_positions():
    """GPT-2 has a learned position table of n_positions rows: prompt and answer must fit in it."""
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=1024, n_embd=32, n_layer=1, n_head=2))
    result = needle.evaluate_needles(model.train(), tokenizer, depths=[1.0], haystack=HAYSTACK, progress=False)
    assert result.lengths == [1024] and len(result.accuracy[0]) == 1
    assert model.training  # put back as it was


def test_needle_evaluation_restores_the_mode_after_an_exception(monkeypatch):
    model = DiffLlamaForCausalLM(tiny_config("dex", max_position_embeddings=512)).train()

    def failing(model, prompt):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(needle, "score_prompt", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        needle.evaluate_needles(model, byte_tokenizer(), lengths=[256], depths=[0.5], haystack=HAYSTACK,
                                progress=False)
    assert model.training


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(0)
    return DiffLlamaForCausalLM(tiny_config("v1"))


def test_diagnose_refuses_batches_without_a_token_to_predict(small_model):
    ids = torch.randint(3, 90, (2, 8))
    with pytest.raises(ValueError, match="attention_mask marks no real token: the batch is all padding"):
        D.diagnose(small_model, ids, torch.zeros_like(ids), progress=False)
    with pytest.raises(ValueError, match="input_ids must hold a token to predict"):
        D.diagnose(small_model, ids[:, :1], progress=False)
    mask = torch.zeros_like(ids)
    mask[:, 0] = 1  # one real token per sequence: nothing to predict either
    with pytest.raises(ValueError, match="input_ids must hold a token to predict"):
        D.diagnose(small_model, ids, mask, progress=False)


def test_diagnose_restores_the_mode_after_an_exception(small_model, monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(D, "lm_loss", failing)
    small_model.train()
    with pytest.raises(RuntimeError, match="interrupted"):
        D.diagnose(small_model, torch.randint(3, 90, (1, 8)), progress=False)
    assert small_model.training


def test_model_card_says_how_to_install_from_source(small_model):
    text = str(model_card(small_model, "org/tiny"))
    assert "pypi.org" not in text and "not published on PyPI" in text and "`pip install .`" in text


# ----------------------------------------------------------------------------------------------------------
# `modeling-diff export SRC DST`: the converter's guards on DST, every bad input one line before the model loads.
# ----------------------------------------------------------------------------------------------------------


def export_error(argv, capsys) -> str:
    from modeling_diff.conversion.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["export", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    return errors[0]


def test_export_refuses_a_destination_in_or_around_its_source(model_dir, tmp_path, capsys, no_model_loading):
    before = tree_hash(model_dir)
    overwrite = ["--overwrite"]
    for dst, flags in ((model_dir, overwrite), (model_dir / "hub", []), (model_dir.parent, overwrite * 2)):
        line = export_error([str(model_dir), str(dst), *flags], capsys)
        assert "must not be, contain or lie inside the source" in line
    assert tree_hash(model_dir) == before


def test_export_overwrites_an_earlier_output_only_unless_told_twice(model_dir, tmp_path, capsys):
    from modeling_diff.conversion.cli import main

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("precious")
    line = export_error([str(model_dir), str(notes), "--overwrite"], capsys)
    assert "holds no config.json, so it is not an earlier output" in line
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]
    assert main(["export", str(model_dir), str(notes), "--overwrite", "--overwrite"]) == 0
    assert (notes / "config.json").is_file() and not (notes / "todo.txt").exists()
    assert main(["export", str(model_dir), str(notes), "--overwrite"]) == 0  # now an earlier output


@pytest.mark.parametrize("config_text,message", [
    ("null", "must hold a JSON object, got null"),
    ("[1]", "must hold a JSON object, got [1]"),
    ("{", "is not valid JSON"),
    (None, "must hold model.safetensors or model.safetensors.index.json"),  # a config and no weights
])
def test_export_refuses_a_broken_source_in_one_line(model_dir, tmp_path, capsys, config_text, message):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((model_dir / "config.json").read_text() if config_text is None else config_text)
    line = export_error([str(src), str(tmp_path / "out")], capsys)
    assert message in line
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_export_reads_no_shard_or_tokenizer_the_converter_would_not(model_dir, tmp_path, capsys):
    """A shard that is a FIFO hung `export` forever; a corrupt shard was a SafetensorError traceback; a tokenizer.json
    linking out of SRC was read (and would have been exported) as the checkpoint's."""
    src = tmp_path / "src"
    shutil.copytree(model_dir, src)
    (src / "model.safetensors").unlink()
    os.mkfifo(src / "model.safetensors")
    assert "model.safetensors" in export_error([str(src), str(tmp_path / "out")], capsys)
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    assert "is not a readable safetensors file" in export_error([str(src), str(tmp_path / "out")], capsys)
    shutil.copy(model_dir / "model.safetensors", src / "model.safetensors")
    outside = tmp_path / "other-tokenizer.json"
    (src / "tokenizer.json").rename(outside)
    (src / "tokenizer.json").symlink_to(outside)
    line = export_error([str(src), str(tmp_path / "out")], capsys)
    assert "tokenizer.json in" in line and "outside the checkpoint" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-tokenizer.json", "src"]


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_export_refuses_a_config_linking_out_of_the_source(model_dir, tmp_path, capsys, no_model_loading, name):
    """SRC's config.json (or index) linking to another model's was read, and exported, as SRC's: its size was checked,
    not where it leads."""
    src = Path(shutil.copytree(model_dir, tmp_path / "src"))
    other = Path(shutil.copytree(model_dir, tmp_path / "other"))
    if name != "config.json":  # an index naming SRC's own shard, kept in the other model's folder
        (other / name).write_text(json.dumps({"weight_map": {"lm_head.weight": "model.safetensors"}}))
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(other / name)
    line = export_error([str(src), str(tmp_path / "out")], capsys)
    assert f"{name} in {str(src)!r} leads to {str(other / name)!r}" in line and "outside the checkpoint" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["model.safetensors beside the index", "transformers_weights"])
def test_export_refuses_weights_from_pretrained_would_load_from_outside_the_source(model_dir, tmp_path, capsys,
                                                                                    no_model_loading, how):
    """A sharded SRC with a model.safetensors linking to another model's (or config.json's transformers_weights
    naming such a link): from_pretrained loads that file, not the index's shards, and export wrote the other model's
    weights as SRC's, exit 0. The converter's checks read the index only."""
    src = tmp_path / "src"
    DiffLlamaForCausalLM.from_pretrained(model_dir).save_pretrained(src, max_shard_size="100KB")
    other = Path(shutil.copytree(model_dir, tmp_path / "other"))
    name = "model.safetensors" if how.startswith("model") else "weights.safetensors"
    (src / name).symlink_to(other / "model.safetensors")
    if how == "transformers_weights":
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "transformers_weights": name}))
    capsys.readouterr()  # save_pretrained's progress bars
    line = export_error([str(src), str(tmp_path / "out")], capsys)
    assert f"'{name}' in {src} is a link to {str(other / 'model.safetensors')!r}" in line, line
    assert "outside the checkpoint" in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["3 GiB", "FIFO", "link out"])
@pytest.mark.parametrize("name", SIDE_FILES)
def test_export_refuses_a_side_file_transformers_would_read_whole(model_dir, tmp_path, capsys, no_model_loading,
                                                                  name, kind):
    """transformers reads SRC's generation config and tokenizer files whole: 3 GiB ended in a MemoryError inside
    it, and a FIFO would be waited on. Refused, naming the file and the bound, before the model loads."""
    src = Path(shutil.copytree(model_dir, tmp_path / "src"))
    plant_side_file(src, name, kind)
    assert_side_file_refused(export_error([str(src), str(tmp_path / "out")], capsys), src, name, kind)
    assert not (tmp_path / "out").exists()


def rewrite_weights(model: Path, drop: tuple = (), add: dict | None = None) -> None:
    """`model`'s model.safetensors without the tensors `drop` and with the tensors `add`."""
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(model / "model.safetensors").items() if k not in drop}
    save_file({**tensors, **(add or {})}, model / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("attack", ["missing", "unexpected"])
def test_export_refuses_a_checkpoint_missing_a_tensor_or_holding_an_unexpected_one(model_dir, tmp_path, capsys,
                                                                                   attack):
    """A tensor missing from SRC's model.safetensors was exported as random weights with exit status 0 (transformers
    only prints a "MISSING ... newly initialized" report); an unexpected tensor was silently left out of DST. Refused
    in one line naming the tensor, nothing written."""
    src = Path(shutil.copytree(model_dir, tmp_path / "src"))
    name = "model.layers.0.self_attn.q_proj.weight" if attack == "missing" else "model.layers.0.extra.weight"
    rewrite_weights(src, drop=(name,), add={} if attack == "missing" else {name: torch.zeros(2)})
    line = export_error([str(src), str(tmp_path / "out")], capsys)
    assert f"{attack} in its weights: {name}" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("attack", ["missing", "unexpected"])
def test_needle_refuses_a_model_missing_a_tensor_or_holding_an_unexpected_one(model_dir, tmp_path, capsys, attack):
    """A tensor missing from the model's weights was evaluated at transformers' random start (it only prints a load
    report), and its score reported as the model's. One line naming the tensor, no result written."""
    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    name = "model.layers.0.self_attn.q_proj.weight" if attack == "missing" else "model.layers.0.extra.weight"
    rewrite_weights(model, drop=(name,), add={} if attack == "missing" else {name: torch.zeros(2)})
    line = needle_error([str(model), "--out", str(tmp_path / "out"), "--lengths", "128"], capsys)
    assert f"model {str(model)!r} could not be loaded" in line and f"{attack} in its weights: {name}" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_export_refuses_weights_whose_shapes_differ_from_the_config_in_one_line(model_dir, tmp_path, capsys):
    """intermediate_size changed in config.json ended in a RuntimeError traceback ("You set ignore_mismatched_sizes
    to False ... look at the above report"). One line naming the tensors and both shapes."""
    src = Path(shutil.copytree(model_dir, tmp_path / "src"))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    line = export_error([str(src), str(tmp_path / "out")], capsys)
    assert "shapes other than the config's" in line and "model.layers.0.mlp.up_proj.weight" in line, line
    assert f"[{config['intermediate_size']}, 64] in the checkpoint, [{config['intermediate_size'] + 8}, 64]" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def broken_tokenizer_source(model_dir: Path, tmp_path: Path) -> Path:
    """`model_dir` copied with a tokenizer_config.json whose `added_tokens_decoder` maps an id to a number: a
    TypeError inside transformers."""
    src = Path(shutil.copytree(model_dir, tmp_path / "src"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": {"0": 5}}))
    return src


def rejected_tokenizer_json_source(model_dir: Path, tmp_path: Path) -> Path:
    """`model_dir` copied with a tokenizer.json of a model type the tokenizers library does not know: it raises a
    bare Exception."""
    src = Path(shutil.copytree(model_dir, tmp_path / "src"))
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    (src / "tokenizer.json").write_text(json.dumps({**tokenizer, "model": {"type": "Nope"}}))
    return src


@pytest.mark.parametrize("broken", [broken_tokenizer_source, rejected_tokenizer_json_source])
def test_export_and_needle_report_a_broken_tokenizer_in_one_line(model_dir, tmp_path, capsys, broken):
    """`"added_tokens_decoder": {"0": 5}` in tokenizer_config.json was a TypeError traceback in both (what broken
    files raise inside transformers is not only OSError and ValueError); a tokenizer.json that the tokenizers library
    rejects, a bare Exception, was a traceback in both too."""
    src = broken(model_dir, tmp_path)
    assert "could not be loaded" in export_error([str(src), str(tmp_path / "out")], capsys)
    assert "could not be loaded" in needle_error([str(src), "--out", str(tmp_path / "out")], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_export_and_needle_never_run_the_source_s_tokenizer_code_even_answered_yes(model_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    """transformers has no tokenizer class for our config, so an auto_map in tokenizer_config.json made it ask on the
    terminal whether to run the folder's Python, and a "y" ran it (export exited 0). Refused in one line."""
    src = Path(shutil.copytree(model_dir, tmp_path / "src"))
    marker = tmp_path / "ran"
    plant_code(src, marker, "tokenizer")
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    assert "contains custom code" in export_error([str(src), str(tmp_path / "out")], capsys)
    assert "contains custom code" in needle_error([str(src), "--out", str(tmp_path / "out")], capsys)
    assert not marker.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("repo_id", ['a"b\n---\nlicense: evil', "org/team/name", "org/name\n", "café"])
def test_export_refuses_a_repo_id_that_is_no_hub_repository_id(model_dir, tmp_path, capsys, no_model_loading,
                                                               repo_id):
    """--repo-id was pasted verbatim into the model card: a quote broke its loading snippet, a newline injected YAML
    front matter (`license: evil`). One line before the model loads."""
    line = export_error([str(model_dir), str(tmp_path / "out"), "--repo-id", repo_id], capsys)
    assert "--repo-id must be a Hub repository id ('name' or 'namespace/name'" in line, line
    assert list(tmp_path.iterdir()) == []


def test_needle_refuses_a_gguf_file_whose_block_count_is_not_its_layers(tmp_path, capsys, no_model_loading):
    """As the converter: transformers would build the million layers the metadata claims before reading tensors."""
    crafted = write_gguf_header(tmp_path / "model.gguf", 10**6, range(2))
    line = needle_error([str(tmp_path), "--gguf-file", "model.gguf", "--out", str(tmp_path / "out")], capsys)
    assert f"--gguf-file GGUF file {str(crafted)!r}: llama.block_count is 1000000, but its tensors hold 2 layers" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


@pytest.mark.parametrize("kind", ["FIFO", "/dev/zero", "80 MiB", "folder"])
def test_needle_refuses_a_haystack_that_is_not_a_bounded_regular_file(model_dir, tmp_path, capsys, no_model_loading,
                                                                      kind):
    """A FIFO as --haystack was waited on forever, /dev/zero read without end. Refused in one line before anything
    is opened or loaded (the FIFO is refused by its type, never opened)."""
    haystack = tmp_path / "haystack.txt"
    if kind == "FIFO":
        os.mkfifo(haystack)
    elif kind == "/dev/zero":
        haystack.symlink_to("/dev/zero")
    elif kind == "folder":
        haystack.mkdir()
    else:
        with open(haystack, "wb") as file:
            file.truncate(80 << 20)  # sparse: no disk used
    line = needle_error([str(model_dir), "--out", str(tmp_path / "out"), "--haystack", str(haystack)], capsys)
    assert f"--haystack {str(haystack)!r} must be a regular file of at most 67108864 bytes" in line, line
    got = {"FIFO": "a FIFO", "/dev/zero": "a character device", "folder": "a directory"}.get(kind, f"{80 << 20} bytes")
    assert f"got {got}" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["haystack.txt"]


@pytest.mark.parametrize("what", ["--out", "its parent"])
def test_needle_keeps_its_results_when_out_becomes_a_file_during_the_run(model_dir, tmp_path, capsys, monkeypatch,
                                                                         what):
    """A file created at --out (or in place of its parent folder) while the evaluation ran ended in a raw
    NotADirectoryError at the final move, the results lost. One line naming the folder that keeps them."""
    out = tmp_path / "results" / "out"
    blocker = out if what == "--out" else out.parent
    evaluate = needle.evaluate_needles

    def evaluate_then_block(*args, **kwargs):
        result = evaluate(*args, **kwargs)
        shutil.rmtree(blocker, ignore_errors=True)
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("someone else's")
        return result

    monkeypatch.setattr(needle, "evaluate_needles", evaluate_then_block)
    (tmp_path / "haystack.txt").write_text(HAYSTACK)
    if what == "--out":
        out.mkdir(parents=True)
    line = needle_error([str(model_dir), "--lengths", "256", "--depths", "0.5", "--haystack",
                         str(tmp_path / "haystack.txt"), "--out", str(out)], capsys)
    assert f"--out {str(out)!r} is no longer a directory" in line, line
    kept = Path(line.split("the results are kept in ")[1].split("'")[1])
    assert sorted(p.name for p in kept.iterdir()) == ["needle.json", "needle.png"]
    assert json.loads((kept / "needle.json").read_text())["lengths"] == [256]
    assert blocker.read_text() == "someone else's"
    assert not [p for p in tmp_path.rglob(".needle-*")]  # no hidden staging left


def as_pytorch_bin(model: Path, replace: dict | None = None) -> Path:
    """`model`'s weights moved from model.safetensors into a pickled pytorch_model.bin (the tensors `replace`
    replaced); returns that file."""
    from safetensors.torch import load_file

    torch.save({**load_file(model / "model.safetensors"), **(replace or {})}, model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    return model / "pytorch_model.bin"


@pytest.mark.parametrize("attack", ["pytorch_model.bin links out", "a shard of its index links out",
                                    "a shard of its index named .."])
def test_needle_refuses_a_pytorch_model_bin_outside_the_model_folder(model_dir, tmp_path, capsys, no_model_loading,
                                                                     attack):
    """README: the weights (`pytorch_model.bin` and the shards an index names included) must be regular files inside
    the model folder: another model's, linked or named with `..`, would be evaluated as this one. One line with exit
    status 2, before the model loads and before --out is made."""
    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    other = tmp_path / "other"
    other.mkdir()
    as_pytorch_bin(model).rename(other / "pytorch_model.bin")  # another model's weights, outside the folder
    name = {"pytorch_model.bin links out": "pytorch_model.bin",
            "a shard of its index links out": "pytorch_model-00001-of-00001.bin",
            "a shard of its index named ..": "../other/pytorch_model.bin"}[attack]
    if attack.startswith("a shard"):
        weights = torch.load(other / "pytorch_model.bin", weights_only=True)
        index = {"metadata": {}, "weight_map": dict.fromkeys(weights, name)}
        (model / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    if attack.endswith("links out"):
        (model / name).symlink_to(other / "pytorch_model.bin")
    line = needle_error([str(model), "--out", str(tmp_path / "out")], capsys)
    assert f"{name} in {str(model)!r} leads to {str((other / 'pytorch_model.bin').resolve())!r}" in line, line
    assert "outside the checkpoint" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "other"]


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_needle_refuses_weights_of_another_shape_than_the_config(model_dir, tmp_path, capsys, weights):
    """README: a model whose weights are not exactly those its config describes (a tensor of another shape:
    transformers only prints a report and re-initializes it at random) is one line with exit status 2, naming the
    tensor and both shapes; no result is written."""
    from safetensors.torch import load_file, save_file

    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    name = "model.layers.0.mlp.up_proj.weight"
    shape = list(load_file(model / "model.safetensors")[name].shape)
    wider = torch.zeros(shape[0] + 8, shape[1])
    if weights == "model.safetensors":
        save_file({**load_file(model / "model.safetensors"), name: wider}, model / "model.safetensors",
                  metadata={"format": "pt"})
    else:
        as_pytorch_bin(model, {name: wider})
    line = needle_error([str(model), "--out", str(tmp_path / "out"), "--lengths", "128"], capsys)
    assert f"model {str(model)!r} could not be loaded" in line and "shapes other than the config's" in line, line
    assert f"{name} {[shape[0] + 8, shape[1]]} in the checkpoint, {shape} by the config" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
