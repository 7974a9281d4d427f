"""atomic_directory: a directory appears whole or not at all, and nothing is replaced without overwrite."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from modeling_diff.atomic import atomic_directory


def test_written_whole_and_staging_removed_on_failure(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_directory(dst) as staging:
            (staging / "half.txt").write_text("x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_directory(dst) as staging:
        (staging / "whole.txt").write_text("x")
    assert [p.name for p in dst.iterdir()] == ["whole.txt"] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_existing_content_needs_overwrite(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    with atomic_directory(dst) as staging:  # an empty directory may be filled
        (staging / "a").write_text("1")
    with pytest.raises(ValueError, match="destination .* not empty; pass overwrite=True"):
        with atomic_directory(dst):
            pass
    with atomic_directory(dst, overwrite=True) as staging:
        (staging / "b").write_text("2")
    assert [p.name for p in dst.iterdir()] == ["b"] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_refuses_the_source_and_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "file").write_text("x")
    for dst in (tmp_path / "src", tmp_path / "src" / "inner", tmp_path):
        with pytest.raises(ValueError, match="must not be, contain or lie inside the source"):
            with atomic_directory(dst, overwrite=True, protect=(tmp_path / "src",)):
                pass
    with pytest.raises(ValueError, match="save_directory .* is not a directory"):
        with atomic_directory(tmp_path / "file", name="save_directory"):
            pass


def test_a_signal_between_the_two_renames_waits_for_them(tmp_path, monkeypatch):
    """SIGTERM (or Ctrl-C) right after the old output was moved aside: the new one is still put in place first."""
    dst = tmp_path / "out"
    with atomic_directory(dst) as staging:
        (staging / "config.json").write_text("old")
    rename = Path.rename

    def rename_then_terminate(self, target):
        result = rename(self, target)
        if self == dst:  # the old output moved aside, the new one not yet in place
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(Path, "rename", rename_then_terminate)
    with pytest.raises(KeyboardInterrupt, match="terminated by signal SIGTERM"):
        with atomic_directory(dst, overwrite=True) as staging:
            (staging / "config.json").write_text("new")
    assert (dst / "config.json").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back


def test_a_writer_killed_between_the_two_renames_leaves_the_old_output_to_the_next(tmp_path):
    """SIGKILL (or a power cut) is not deferred: a writer killed after it moved the old output aside and before it
    renamed the new one into place left the destination missing, the old output only in its `.old` directory. The
    next writer to the destination puts it back before it removes the dead writer's directories."""
    dst = (tmp_path / "out").resolve()
    with atomic_directory(dst) as staging:
        (staging / "config.json").write_text("old")
    killed_between = f"""
import os, signal
from pathlib import Path
from modeling_diff.atomic import atomic_directory
rename = Path.rename
def rename_then_die(self, target):
    result = rename(self, target)
    if self == Path({str(dst)!r}):  # the old output moved aside, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
    return result
Path.rename = rename_then_die
with atomic_directory({str(dst)!r}, overwrite=True) as staging:
    (staging / "config.json").write_text("new")
"""
    assert subprocess.run([sys.executable, "-c", killed_between]).returncode == -signal.SIGKILL
    assert not dst.exists() and any(p.name.endswith(".old") for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="exists and is not empty"):  # the old output is back, not replaced
        with atomic_directory(dst):
            pass
    assert (dst / "config.json").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_parents_it_created_are_removed_on_failure(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "a" / "b" / "out"):
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["dst", "a parent"])
def test_a_destination_through_a_link_to_nothing_is_refused(tmp_path, where, capsys):
    """`ln -s elsewhere/deep/er/out dst; modeling-diff convert SRC dst` wrote into elsewhere/deep/er/out, creating
    its folders: refused, as the needle evaluation refuses such an --out; nothing is created anywhere."""
    from test_conversion import tiny_llama

    from modeling_diff.conversion.cli import main

    tiny_llama().save_pretrained(tmp_path / "src")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere" / "deep" / "er" / "out")
    dst = link if where == "dst" else link / "out"
    with pytest.raises(ValueError, match=f"{str(link)!r} is a link to nothing"):
        with atomic_directory(dst):
            pass
    with pytest.raises(SystemExit) as exit_info:  # the converter's command line
        main(["convert", str(tmp_path / "src"), str(dst), "--heads", "all"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "is a link to nothing" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "src"]
