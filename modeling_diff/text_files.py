"""Text files a user names on a command line (`--calibration-file`, `--haystack`, `--text-file`): read safely.

A FIFO or a device is never opened (it would be waited on, or read, forever), and neither is a file such as those of
/proc, which report a size of 0 and may block when read (/proc/kmsg) or fail (/proc/self/mem). The file is opened
without blocking and checked again through its descriptor, in case it was replaced in between."""

import codecs
import os
import re
import stat
from pathlib import Path

_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # what surrogateescape decodes the bytes that are not UTF-8 to


def read_text_file(path: Path, name: str, *, max_bytes: int | None = None, max_chars: int | None = None) -> str:
    """The UTF-8 text of the file `path` that option `name` gave: its first `max_chars` characters if given (a file
    of gigabytes is not read whole), else all of it, refused above `max_bytes` if given; newlines as Python's text
    mode reads them (CR LF and a lone CR are LF). Anything else is a ValueError naming the option, the path and the
    rule."""
    where = f"{name} {str(path)!r}"
    rule = f"{where} must be a regular file " + (
        f"of at most {max_bytes} bytes of text (it is read whole)" if max_bytes is not None else "of text")

    def check(info: os.stat_result) -> None:
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{rule}, got {_file_kind(info.st_mode)}")
        if info.st_size == 0:
            raise ValueError(f"{rule}: it is empty, or a file that reports no size (such as those of /proc), which "
                             f"is not read")
        if max_bytes is not None and info.st_size > max_bytes:
            raise ValueError(f"{rule}, got {info.st_size} bytes")

    try:
        check(path.stat())
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            check(os.fstat(file.fileno()))
            # a UTF-8 character takes at most 4 bytes; one byte past max_bytes tells a file that grew
            data = file.read(4 * max_chars if max_chars is not None else max_bytes + 1 if max_bytes is not None else -1)
    except FileNotFoundError as error:
        raise ValueError(f"{where} is not a file: it does not exist") from error
    except OSError as error:  # permissions, a loop of links, a disk error (EIO)
        raise ValueError(f"{where} cannot be read: {error.strerror or error}") from error
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"{rule}, got more than that (it grew while it was read)")
    # Bytes that are not UTF-8 decode to lone surrogates, which UTF-8 text never holds: only those of the text
    # returned count (the bytes read past the opening may end inside a character, or hold anything).
    at_end = max_chars is None or len(data) < 4 * max_chars
    text = codecs.getincrementaldecoder("utf-8")("surrogateescape").decode(data, final=at_end)
    text = text.replace("\r\n", "\n").replace("\r", "\n")[:max_chars]  # newlines as Python's text mode reads them
    bad = _NOT_UTF8.search(text)
    if bad is not None:
        raise ValueError(f"{where} is not UTF-8 text: character {bad.start()} is the byte "
                         f"{ord(bad.group()) - 0xDC00:#04x}")
    return text


def _file_kind(mode: int) -> str:
    """What a file of `os.stat` mode `mode` that is not a regular file is, in words."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")
