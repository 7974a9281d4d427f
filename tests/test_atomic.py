"""atomic_directory: a directory appears whole or not at all, and nothing is replaced without overwrite."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import unwritable

from modeling_diff.atomic import InterruptedAfterWriting, atomic_directory, check_writable, locked_staging


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


def test_locked_staging_removes_what_it_must_and_keeps_what_it_is_left(tmp_path):
    """The staging of a writer that moves its files into the destination itself: removed when the block fails, or
    when it succeeds with the staging emptied; left when the block leaves files in it (kept on purpose); another
    writer is refused, or waited for up to `wait_seconds`."""
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with locked_staging(dst, "--out") as staging:
            (staging / "half.txt").write_text("x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with locked_staging(dst, "--out") as staging:
        (staging / "a.txt").write_text("x")
        dst.mkdir()
        (staging / "a.txt").replace(dst / "a.txt")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    with locked_staging(dst, "--out") as staging:
        (staging / "kept.txt").write_text("x")
    assert staging.is_dir() and [p.name for p in staging.iterdir()] == ["kept.txt"]

    holder = locked_staging(dst, "--out")
    held = holder.__enter__()
    with pytest.raises(ValueError, match=rf"--out '{dst}' is being written by another process \(pid {os.getpid()}"):
        with locked_staging(dst, "--out"):
            pass
    assert held.is_dir()
    release = threading.Timer(0.3, holder.__exit__, (None, None, None))
    release.start()
    with locked_staging(dst, "--out", wait_seconds=30) as staging:  # waited for; the first's staging is gone
        assert not held.exists() and staging.is_dir()
    release.join()


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
    with pytest.raises(KeyboardInterrupt) as raised:
        with atomic_directory(dst, overwrite=True) as staging:
            (staging / "config.json").write_text("new")
    # raised once the new output was in place, and saying so (a command's line must not say nothing was written)
    assert isinstance(raised.value, InterruptedAfterWriting) and raised.value.path == dst
    assert str(raised.value.__cause__) == "terminated by signal SIGTERM"
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


# ----------------------------------------------------------------------------------------------------------
# Killed writers whose pid is this process's (a container's writer is PID 1 on every run), live writers in other
# processes, and names as long as the filesystem allows.
# ----------------------------------------------------------------------------------------------------------

# A writer in a process of its own, loading `atomic_directory` from its file (without torch: it starts in
# milliseconds). Given a pid, it names its directories with it, as a writer with that pid does: a container's
# converter is PID 1 on every run, so a rerun's pid is the dead run's. It stops (prints READY and waits for a line
# on stdin, or sleeps) mid-write or between the two renames of its replacement of `dst`, to be killed or resumed.
_WRITER = """
import importlib.util, os, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
atomic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(atomic)
dst, pid, stop = Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if pid:
    os.getpid = lambda: pid
rename = Path.rename
def rename_then_stop(self, target):
    result = rename(self, target)
    if self == dst and stop == "between the renames":  # the old output moved aside, the new one not yet in place
        print("READY", flush=True)
        time.sleep(120)
    return result
Path.rename = rename_then_stop
with atomic.atomic_directory(dst, overwrite=True, expected=("config.json",)) as staging:
    (staging / "model.safetensors").write_bytes(bytes(1 << 20))
    (staging / "config.json").write_text("new")
    if stop == "mid-write":
        print("READY", flush=True)
        sys.stdin.readline()
"""


def _start_writer(dst: Path, stop: str, pid: int = 0) -> subprocess.Popen:
    import modeling_diff.atomic

    process = subprocess.Popen([sys.executable, "-c", _WRITER, modeling_diff.atomic.__file__, str(dst), str(pid),
                                stop], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "READY"
    return process


def _kill(process: subprocess.Popen) -> None:
    process.kill()  # SIGKILL: nothing of the writer runs, as after the OOM killer or `docker kill`
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


def _long_name(directory: Path, fill: str = "a") -> str:
    """The longest name the filesystem of `directory` allows (255 bytes on most), of `fill` characters."""
    return fill * (os.pathconf(directory, "PC_NAME_MAX") // len(fill.encode()))


@pytest.mark.parametrize("dst_name", ["out", "longest"])
def test_a_killed_writer_of_this_very_pid_leaves_nothing_to_the_next(tmp_path, dst_name):
    """A writer SIGKILLed mid-write whose pid was this process's (containers: PID 1, run after run): its staging
    directory was kept for ever, "its process still runs". Whoever holds the lock knows that no other writer of the
    destination runs, whatever the pid in a name: the next writer removes it."""
    dst = tmp_path / (_long_name(tmp_path) if dst_name == "longest" else dst_name)
    _kill(_start_writer(dst, "mid-write", pid=os.getpid()))
    (left,) = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # with the half-written output
    assert f".{os.getpid()}." in left.name and (left / "model.safetensors").is_file() and not dst.exists()
    with atomic_directory(dst) as staging:
        (staging / "config.json").write_text("rerun")
    assert (dst / "config.json").read_text() == "rerun" and [p.name for p in tmp_path.iterdir()] == [dst.name]


@pytest.mark.parametrize("dst_name", ["out", "longest"])
def test_a_writer_of_this_very_pid_killed_between_the_two_renames_has_the_old_output_put_back(tmp_path, dst_name):
    """Killed after it moved the old output aside and before the new one was in place, with this process's pid
    (containers): the next writer wrote a fresh destination without overwrite (exit 0), the old output hidden in the
    dead writer's `.old`, and a later writer of another pid deleted it. It is put back first: not replaced without
    overwrite, and nothing hidden is left."""
    dst = tmp_path / (_long_name(tmp_path) if dst_name == "longest" else dst_name)
    with atomic_directory(dst) as staging:
        (staging / "config.json").write_text("old")
    _kill(_start_writer(dst, "between the renames", pid=os.getpid()))
    assert not dst.exists() and any(p.name.endswith(".old") for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="exists and is not empty"):  # the old output is back, not replaced
        with atomic_directory(dst):
            pass
    assert (dst / "config.json").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [dst.name]
    with atomic_directory(dst, overwrite=True, expected=("config.json",)) as staging:  # and replaced when asked
        (staging / "config.json").write_text("new")
    assert (dst / "config.json").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == [dst.name]


def test_leftovers_named_with_this_pid_are_removed_and_look_alikes_kept(tmp_path):
    """Staging directories named with this process's pid that no writer holds (the lock is free) are a dead
    writer's; those of another destination, and names no writer makes, are left alone."""
    pid = os.getpid()
    staging, old = tmp_path / f".out.{pid}.abcd1234.tmp", tmp_path / f".out.{pid}.0123abcd.old"
    (staging / "half").mkdir(parents=True)
    (old / "out").mkdir(parents=True)
    (old / "out" / "config.json").write_text("old")
    kept = [tmp_path / f".out2.{pid}.abcd1234.tmp", tmp_path / f".out.{pid}.abcd1234.tmp.1",
            tmp_path / ".out.2024.backup.old", tmp_path / f".out.{pid}.abc.tmp", tmp_path / ".out.notes",
            tmp_path / ".out.99999999999999999999.abcd1234.tmp"]  # (no pid has 20 digits)
    for path in kept:
        path.mkdir()
    with pytest.raises(ValueError, match="exists and is not empty"):
        with atomic_directory(tmp_path / "out"):
            pass
    assert (tmp_path / "out" / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *(p.name for p in kept)])


def test_a_live_writer_in_another_process_is_never_touched(tmp_path, monkeypatch):
    """Two writers of one destination, in two processes: the second is refused (with its own pid, and with the
    first one's, as two containers sharing a volume can have) and leaves the first's staging directory alone, as do
    writers of other destinations beside it, one named like the first's staging; the first then completes."""
    dst = tmp_path / "out"
    first = _start_writer(dst, "mid-write")
    try:
        (staging,) = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        for pid in (os.getpid(), first.pid):
            monkeypatch.setattr(os, "getpid", lambda: pid)
            with pytest.raises(ValueError, match="is being written by another process"):
                with atomic_directory(dst, overwrite=True):
                    pass
            monkeypatch.undo()
        for other in ("out2", f"out.{first.pid}", "ou"):
            with atomic_directory(tmp_path / other) as other_staging:
                (other_staging / "config.json").write_text(other)
        assert (staging / "model.safetensors").is_file() and not dst.exists()
        first.communicate("go on\n", timeout=60)
    finally:
        first.kill()
    assert first.returncode == 0 and (dst / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", "out2", f"out.{first.pid}", "ou"])


@pytest.mark.parametrize("length", [-25, -24, -15, -6, -5, 0, "é"])
def test_any_name_the_filesystem_allows_is_written_and_replaced(tmp_path, length):
    """A name of 234 to 249 bytes (of 255) failed with a bare "[Errno 36] File name too long" on the staging
    directory (which adds up to 22 bytes), and one of 250 or more on the lock file: the names of both are made of
    the start of the name and a hash of it where the whole would be too long, cut at a character."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    name = _long_name(tmp_path, "é") if length == "é" else "a" * (limit + length)
    dst = tmp_path / name
    for content in ("first", "second"):  # the second replaces the first (its `.old`)
        with atomic_directory(dst, overwrite=True, expected=("config.json",)) as staging:
            assert len(os.fsencode(staging.name)) <= limit
            staging.name.encode("utf-8")  # a UTF-8 path, as safetensors and tokenizers need
            (staging / "config.json").write_text(content)
    assert (dst / "config.json").read_text() == "second" and [p.name for p in tmp_path.iterdir()] == [name]


def test_a_name_longer_than_the_filesystem_allows_is_refused_in_one_line(tmp_path):
    dst = tmp_path / "new" / ("a" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1))
    with pytest.raises(ValueError, match=r"a name in it is \d+ bytes long, and its filesystem allows at most \d+"):
        with atomic_directory(dst):
            pass
    assert list(tmp_path.iterdir()) == []


def test_check_writable_follows_a_link_to_where_the_staging_goes(tmp_path):
    """A destination that is a link to a folder: `atomic_directory` stages next to the folder it leads to, so that
    folder's parent is tried, not the link's (which let a training run end before its output could be written)."""
    locked, links = tmp_path / "locked", tmp_path / "links"
    (locked / "target").mkdir(parents=True)
    links.mkdir()
    (links / "out").symlink_to(locked / "target")
    with unwritable(locked):
        with pytest.raises(ValueError, match=r"^--out '.*/links/out' cannot be written: \[Errno"):
            check_writable(links / "out", "--out")
        with pytest.raises(ValueError, match="cannot be written"):  # what the check foresees
            with atomic_directory(links / "out", overwrite=True):
                pass
    check_writable(links / "out", "--out")
    assert list(links.iterdir()) == [links / "out"] and list((locked / "target").iterdir()) == []


def test_check_writable_tries_the_folder_the_staging_goes_into(tmp_path):
    check_writable(tmp_path / "new" / "deeper" / "out", "--out")  # made later by atomic_directory: its parent is tried
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing
    # /proc takes no new entry, whatever the permissions say (root ignores them)
    with pytest.raises(ValueError, match=r"^--out '/proc/no-such/out' cannot be written: \[Errno"):
        check_writable("/proc/no-such/out", "--out")
