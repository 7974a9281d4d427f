"""`modeling-diff convert SRC DST` works without --calibration-file: DEX's entropy heads are chosen on the text
shipped in the package (`modeling_diff/conversion/calibration.txt`), and the command says so."""

import json
from importlib.resources import files

import pytest
import torch
from ecosystem_helpers import VOCAB_SIZE, byte_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_diff.conversion import convert_model
from modeling_diff.conversion.cli import main


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    eos = VOCAB_SIZE - 1
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=eos, eos_token_id=eos,
    ))
    path = tmp_path_factory.mktemp("default_calibration") / "llama"
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return model, path


def shipped_text() -> str:
    return (files("modeling_diff.conversion") / "calibration.txt").read_text(encoding="utf-8")


def test_the_shipped_text_is_the_opening_of_hamlet_and_long_enough():
    text = shipped_text()
    assert text.startswith("FRANCISCO at his post.") and "Who's there?" in text
    assert len(text) >= 4 * 512  # >= 512 tokens of a BPE tokenizer (under 4 characters a token in English)


def test_convert_without_calibration_file_selects_heads_on_the_shipped_text(llama_dir, tmp_path, capsys):
    model, src = llama_dir
    assert main(["convert", str(src), str(tmp_path / "dex")]) == 0
    output = capsys.readouterr()
    assert "packaged calibration text" in output.out + output.err and "--calibration-file" in output.out + output.err
    ids = byte_tokenizer()(shipped_text(), return_tensors="pt").input_ids[:, :512]
    expected = convert_model(model, calibration=ids, progress=False).config.dex_heads
    assert json.loads((tmp_path / "dex" / "config.json").read_text())["dex_heads"] == expected


def test_without_a_tokenizer_the_error_says_what_is_missing(llama_dir, tmp_path, capsys):
    model, _ = llama_dir
    model.save_pretrained(tmp_path / "bare")
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(tmp_path / "bare"), str(tmp_path / "dex"), "--quiet"])
    assert exit_info.value.code == 2 and "tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "dex").exists()
