"""`modeling-diff convert`: the command line over `convert_checkpoint`."""

import importlib.metadata
import json

import pytest
import torch
from test_conversion import tiny_llama, token_ids
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from modeling_diff.conversion import convert_model
from modeling_diff.conversion.cli import main

TEXT = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 4


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory):
    """A tiny Llama checkpoint with a byte-level tokenizer (ids 0..255 < vocab_size 300)."""
    path = tmp_path_factory.mktemp("cli") / "llama"
    source = tiny_llama()
    source.save_pretrained(path)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.save_pretrained(path)
    return source, tokenizer, path


def test_convert_with_entropy_heads_from_a_text_file(source_dir, tmp_path, capsys):
    source, tokenizer, src = source_dir
    (tmp_path / "sonnet.txt").write_text(TEXT)
    dst = tmp_path / "dex"
    assert main(["convert", str(src), str(dst), "--calibration-file", str(tmp_path / "sonnet.txt"),
                 "--head-fraction", "0.25", "--anneal-steps", "50"]) == 0
    summary = capsys.readouterr().out
    assert f"output     {dst}" in summary and "method     dex" in summary and "DEX heads  3 of 12" in summary

    config = json.loads((dst / "config.json").read_text())
    calibration = tokenizer(TEXT, return_tensors="pt").input_ids
    expected = convert_model(source, head_fraction=0.25, calibration=calibration, progress=False)
    assert config["dex_heads"] == expected.config.dex_heads and config["anneal_steps"] == 50
    assert (dst / "tokenizer.json").is_file()
    ids = token_ids()
    with torch.no_grad():
        converted = AutoModelForCausalLM.from_pretrained(dst).eval()
        assert (converted(ids).logits - source(ids).logits).abs().max() <= 1e-4


def test_convert_v2_with_options(source_dir, tmp_path):
    _, _, src = source_dir
    dst = tmp_path / "v2"
    assert main(["convert", str(src), str(dst), "--method", "v2", "--noise-init", "zeros", "--anneal-steps", "3",
                 "--quiet"]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["diff_mode"] == "v2" and config["anneal_steps"] == 3 and config["dex_heads"] is None
    q_proj = AutoModelForCausalLM.from_pretrained(dst).model.layers[0].self_attn.q_proj.weight.view(4, 2, 16, 64)
    assert not q_proj[:, 1].any()


@pytest.mark.parametrize("heads,expected", [("all", [[0, 1, 2, 3]] * 3), ("1,3", [[1, 3]] * 3),
                                            ("[[0],[1,2],[3]]", [[0], [1, 2], [3]])])
def test_heads_argument(source_dir, tmp_path, heads, expected):
    _, _, src = source_dir
    assert main(["convert", str(src), str(tmp_path / "out"), "--heads", heads, "--quiet"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dex_heads"] == expected


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--heads", "best"], "--heads must be 'entropy', 'all'"),
        # options of one method are refused elsewhere (they were ignored, as if applied)
        (["--heads", "all", "--head-fraction", "0.25"], "--head-fraction applies to --method dex with --heads entropy"),
        (["--method", "v2", "--head-fraction", "0.25"], "--head-fraction applies to --method dex with --heads entropy"),
        (["--noise-init", "zeros"], "--noise-init applies to --method v2 only (its noise heads), got --method dex"),
        (["--method", "dex", "--noise-init", "copy"], "--noise-init applies to --method v2 only"),
        (["--calibration-file", "/nonexistent.txt"], "is not a file"),
        (["--method", "v2", "--anneal-steps", "0"], "anneal_steps must be >= 1"),
        (["--method", "v3"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_with_status_2(source_dir, tmp_path, capsys, extra, message):
    _, _, src = source_dir
    argv = ["convert", str(src), str(tmp_path / "out"), "--quiet", *extra]
    if message is None:
        assert main(argv) == 0
        return
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_existing_destination_needs_overwrite(source_dir, tmp_path, capsys):
    _, _, src = source_dir
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    with pytest.raises(SystemExit):
        main(["convert", str(src), str(dst), "--heads", "all", "--quiet"])
    assert "exists and is not empty; pass overwrite=True" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a checkpoint: one --overwrite is not enough
        main(["convert", str(src), str(dst), "--heads", "all", "--quiet", "--overwrite"])
    assert "holds no config.json" in capsys.readouterr().err and (dst / "keep.txt").is_file()
    assert main(["convert", str(src), str(dst), "--heads", "all", "--quiet", "--overwrite", "--overwrite"]) == 0
    assert (dst / "config.json").is_file() and not (dst / "keep.txt").exists()
    assert main(["convert", str(src), str(dst), "--heads", "1", "--quiet", "--overwrite"]) == 0  # an earlier output
    assert json.loads((dst / "config.json").read_text())["dex_heads"] == [[1]] * 3


def test_console_script_points_at_main():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    (entry_point,) = [ep for ep in scripts if ep.name == "modeling-diff"]
    assert entry_point.load() is main
