"""`read_text_file`: the one reader of the text files users name (--calibration-file, --haystack, --text-file)."""

import os
from pathlib import Path

import pytest

from modeling_diff.text_files import read_text_file


def test_the_opening_keeps_whole_characters(tmp_path):
    """Only the first max_chars characters are read; a multi-byte character cut by the bytes read is left out, not
    a UnicodeDecodeError (each 'é' is 2 bytes, '€' 3, '𝄞' 4)."""
    path = tmp_path / "text.txt"
    text = "é€𝄞a" * 1000
    path.write_text(text, encoding="utf-8")
    for max_chars in (1, 2, 3, 5, 7, 1001, 4000, 10**6):
        assert read_text_file(path, "--x", max_chars=max_chars) == text[:max_chars]


def test_a_whole_read_is_bounded(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("x" * 100)
    assert read_text_file(path, "--x", max_bytes=100) == "x" * 100
    with pytest.raises(ValueError, match=r"--x .* must be a regular file of at most 99 bytes of text .*got 100 bytes"):
        read_text_file(path, "--x", max_bytes=99)


@pytest.mark.parametrize("kind,got", [("FIFO", "got a FIFO"), ("folder", "got a directory"),
                                      ("/dev/null", "got a character device"), ("empty", "it is empty"),
                                      ("/proc/self/status", "reports no size"), ("missing", "it does not exist"),
                                      ("latin-1", "is not UTF-8 text")])
def test_what_is_not_a_regular_file_of_utf8_text_is_refused_naming_the_option(tmp_path, kind, got):
    path = tmp_path / "in.txt"
    if kind == "FIFO":
        os.mkfifo(path)  # opening it would wait for a writer forever
    elif kind == "folder":
        path.mkdir()
    elif kind.startswith("/"):
        path = Path(kind)
    elif kind == "empty":
        path.touch()
    elif kind == "latin-1":  # the file ends inside what would be a character of 3 bytes
        path.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError) as error:
        read_text_file(path, "--text-file", **({"max_chars": 512} if kind == "latin-1" else {}))
    assert str(error.value).startswith(f"--text-file {str(path)!r} ") and got in str(error.value), error.value


def test_only_the_opening_must_be_utf8_and_newlines_read_as_text_mode_reads_them(tmp_path):
    """A byte that is not UTF-8 past the opening (in the bytes read beyond it) refused a calibration file that the
    text-mode reader took; and CR LF came back as it is, where text mode (the readers before) gave LF."""
    path = tmp_path / "text.txt"
    path.write_bytes(b"a\r\nb\rc" + b"x" * 100 + b"\xe9" + b"y" * 100)
    assert read_text_file(path, "--x", max_chars=50) == "a\nb\nc" + "x" * 45
    with pytest.raises(ValueError, match=r"--x .* is not UTF-8 text: character 105 is the byte 0xe9"):
        read_text_file(path, "--x")
