"""The converter's promises, attacked (issue 14): it never touches the source, never writes outside DST, never
leaves a half-written output or a staging directory behind, never replaces without --overwrite, and refuses every
bad input up front with a one-line error (exit status 2 on the command line)."""

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import unwritable
from ecosystem_helpers import byte_tokenizer, write_gguf_header
from safetensors import SafetensorError
from test_conversion import tiny_llama, token_ids
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import modeling_diff.conversion.convert as convert_module
from modeling_diff import DiffLlamaForCausalLM, preset_config
from modeling_diff.conversion import convert_checkpoint, convert_model
from modeling_diff.conversion.cli import main

INDEX = "model.safetensors.index.json"
TEXT = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. " * 3


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A sharded tiny Llama checkpoint with a byte-level tokenizer; tests convert copies of it."""
    path = tmp_path_factory.mktemp("pristine") / "llama"
    tiny_llama().save_pretrained(path, max_shard_size="100KB")
    byte_tokenizer().save_pretrained(path)
    assert (path / INDEX).is_file()
    return path


@pytest.fixture
def src(pristine, tmp_path):
    return Path(shutil.copytree(pristine, tmp_path / "src"))


def tree_hash(root: Path) -> dict[str, str]:
    """Every file under `root` (links not followed) -> sha256 of its bytes (or of its link target)."""
    hashes = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            hashes[str(path.relative_to(root))] = "link:" + os.readlink(path)
        elif path.is_file():
            hashes[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def hidden_leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def cli_error(argv: list[str], capsys, quiet: bool = True) -> str:
    """Run the command line, which must exit with status 2 and a one-line error (no traceback); return that line."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--quiet"] if quiet else argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    # argparse prints its usage (lines from "usage:" on, indented continuations) before the error line.
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert len(lines) == 1 and lines[0].startswith("modeling-diff") and ": error: " in lines[0], err
    return lines[0]


# ----------------------------------------------------------------------------------------------------------
# 1. Names read from the index are plain file names inside the checkpoint.
# ----------------------------------------------------------------------------------------------------------


def _rename_in_index(src: Path, old: str, new: str) -> None:
    index = json.loads((src / INDEX).read_text())
    index["weight_map"] = {name: (new if file == old else file) for name, file in index["weight_map"].items()}
    (src / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("kind", ["parent", "absolute", "subdir", "hidden"])
def test_index_shard_names_outside_the_checkpoint_are_refused(src, tmp_path, capsys, kind):
    shard = json.loads((src / INDEX).read_text())["weight_map"]["model.embed_tokens.weight"]
    victim = tmp_path / "victim.safetensors"
    shutil.copy(src / shard, victim)
    name = {"parent": f"../src/{shard}", "absolute": str(victim), "subdir": f"sub/{shard}",
            "hidden": f".{shard}"}[kind]
    _rename_in_index(src, shard, name)
    before, victim_before = tree_hash(src), victim.read_bytes()
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert "must be a plain .safetensors file name" in line and repr(name) in line
    assert tree_hash(src) == before and victim.read_bytes() == victim_before  # nothing rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "victim.safetensors"]  # nothing written


@pytest.mark.parametrize(
    "weight_map,message",
    [
        ([["model.norm.weight", "model.safetensors"]], "must be JSON with a 'weight_map' object"),
        (None, "must be JSON with a 'weight_map' object"),
        ({"model.norm.weight": 3}, "must be a plain .safetensors file name"),
        ({"model.norm.weight": ["a.safetensors"]}, "must be a plain .safetensors file name"),
    ],
)
def test_malformed_weight_maps_are_refused(src, tmp_path, capsys, weight_map, message):
    (src / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert message in cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert not (tmp_path / "dst").exists()


def test_a_shard_linked_out_of_the_checkpoint_is_refused(src, tmp_path):
    shard = json.loads((src / INDEX).read_text())["weight_map"]["model.norm.weight"]
    outside = tmp_path / "elsewhere.safetensors"
    (src / shard).rename(outside)
    (src / shard).symlink_to(outside)
    with pytest.raises(ValueError, match=f"shard '{shard}' .* is a link to .*outside the checkpoint"):
        convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert not (tmp_path / "dst").exists()


# ----------------------------------------------------------------------------------------------------------
# 2. No check-then-act race: a DST that appears meanwhile is kept; one writer per DST.
# ----------------------------------------------------------------------------------------------------------


def _pausing_conversion(monkeypatch, before_finish):
    """Make `convert_checkpoint` call `before_finish(staging)` after writing its shards, before the rename."""
    original = convert_module._convert_directory

    def convert_directory(source, tmp, mapping, progress):
        original(source, tmp, mapping, progress)
        before_finish(tmp)

    monkeypatch.setattr(convert_module, "_convert_directory", convert_directory)


def test_a_destination_created_during_the_conversion_is_not_replaced(src, tmp_path, monkeypatch):
    dst = tmp_path / "dst"

    def someone_writes_dst(staging):
        dst.mkdir()
        (dst / "theirs.txt").write_text("precious")

    _pausing_conversion(monkeypatch, someone_writes_dst)
    with pytest.raises(ValueError, match="was created by someone else while this one was being written"):
        convert_checkpoint(src, dst, heads="all", progress=False)
    assert [p.name for p in dst.iterdir()] == ["theirs.txt"] and (dst / "theirs.txt").read_text() == "precious"
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.parametrize("overwrite", [True, "force"])
def test_an_earlier_output_replaced_during_the_conversion_by_another_directory(src, tmp_path, monkeypatch, overwrite):
    """A single overwrite replaces only an earlier output (it holds a config.json): checked again on what the final
    rename moves aside, so a directory put in its place meanwhile is kept; "force" (--overwrite twice) replaces it."""
    dst = tmp_path / "dst"
    convert_checkpoint(src, dst, heads=[0], progress=False)

    def someone_replaces_dst(staging):
        shutil.rmtree(dst)
        dst.mkdir()
        (dst / "thesis.tex").write_text("precious")

    _pausing_conversion(monkeypatch, someone_replaces_dst)
    if overwrite is True:
        with pytest.raises(ValueError, match="holding no config.json, so not an earlier output; it was left as it is"):
            convert_checkpoint(src, dst, heads=[1], overwrite=overwrite, progress=False)
        assert [p.name for p in dst.iterdir()] == ["thesis.tex"] and (dst / "thesis.tex").read_text() == "precious"
    else:
        convert_checkpoint(src, dst, heads=[1], overwrite=overwrite, progress=False)
        assert json.loads((dst / "config.json").read_text())["dex_heads"] == [[1]] * 3
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.parametrize("link", ["symbolic", "hard"])
@pytest.mark.parametrize("target", ["a source file", "a file outside"])
def test_a_link_planted_as_the_lock_file_is_refused_and_its_target_untouched(src, tmp_path, capsys, target, link):
    """The lock file `.<DST>.lock` is opened without following links and must be a file of one name: a link planted
    there (symbolic or hard; to a file of the source, or anywhere) is refused in one line, before any work, and the
    file it points to keeps its bytes."""
    victim = src / "tokenizer.json" if target == "a source file" else tmp_path / "victim.txt"
    if not victim.exists():
        victim.write_text("precious")
    before = victim.read_bytes()
    if link == "symbolic":
        (tmp_path / ".dst.lock").symlink_to(victim)
    else:
        os.link(victim, tmp_path / ".dst.lock")
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert "lock file" in line and ("is a symbolic link" if link == "symbolic" else "a file of 2 names") in line
    assert victim.read_bytes() == before and not (tmp_path / "dst").exists()


@pytest.mark.parametrize("kind", ["a link to /dev/zero", "a FIFO", "larger than any config"])
def test_a_config_json_that_is_no_small_regular_file_is_refused_before_it_is_read(src, tmp_path, capsys, kind):
    """Read whole, /dev/zero filled the memory until the kernel killed the process, and a FIFO waited forever."""
    config = src / "config.json"
    config.unlink()
    if kind == "a link to /dev/zero":
        config.symlink_to("/dev/zero")
    elif kind == "a FIFO":
        os.mkfifo(config)
    else:
        with open(config, "wb") as file:
            file.truncate(65 * 2**20)  # sparse: no disk used
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert "config.json" in line and ("must be a directory with a config.json" in line or "regular file" in line)
    assert not (tmp_path / "dst").exists()


def test_a_destination_that_is_a_loop_of_links_is_one_line(src, tmp_path, capsys):
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    for dst in (tmp_path / "loop1", tmp_path / "loop1" / "out"):
        line = cli_error(["convert", str(src), str(dst), "--heads", "all"], capsys)
        assert "cannot be resolved" in line or "is a link to nothing" in line  # (a loop leads to nothing)


def test_a_planted_staging_name_of_no_possible_process_is_kept_and_does_not_stop_the_conversion(src, tmp_path):
    """Stale staging directories are removed when their process is gone; a name whose pid no process can have
    (os.kill overflowed) is not ours: kept, and the conversion goes on."""
    planted = tmp_path / ".dst.99999999999999999999.abc.tmp"
    planted.mkdir()
    (planted / "theirs.txt").write_text("x")
    convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert (planted / "theirs.txt").read_text() == "x"


@pytest.mark.parametrize("dst", ["/usr", "home", "home parent"])
def test_a_top_directory_and_the_home_are_never_replaced(tmp_path, monkeypatch, dst):
    """`--overwrite --overwrite` replaces any directory but these (and the root, which holds the working directory),
    which hold far more than an output."""
    from modeling_diff.atomic import FORCE, check_destination

    home = tmp_path / "users" / "me"
    (home / ".ssh").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path / "elsewhere")  # not refused by the working directory's rule
    with pytest.raises(ValueError, match="never replaced, not even with overwrite='force'"):
        check_destination({"home": home, "home parent": home.parent}.get(dst, Path(dst)), FORCE)


def test_two_conversions_to_one_destination(src, tmp_path, monkeypatch):
    """The second writer is refused while the first holds the destination; the first completes untouched."""
    dst, paused, resume, outcome = tmp_path / "dst", threading.Event(), threading.Event(), {}

    def wait_for_the_second(staging):
        if threading.current_thread().name == "first":
            paused.set()
            assert resume.wait(60)

    def first():
        try:
            outcome["first"] = convert_checkpoint(src, dst, heads=[0], progress=False)
        except BaseException as error:  # reported by the assertion below
            outcome["first"] = error

    _pausing_conversion(monkeypatch, wait_for_the_second)
    thread = threading.Thread(target=first, name="first")
    thread.start()
    try:
        assert paused.wait(60)
        for overwrite in (False, True):
            with pytest.raises(ValueError, match="is being written by another process"):
                convert_checkpoint(src, dst, heads=[1], overwrite=overwrite, progress=False)
    finally:
        resume.set()
        thread.join(60)
    assert outcome["first"] == dst
    assert json.loads((dst / "config.json").read_text())["dex_heads"] == [[0]] * 3
    assert hidden_leftovers(tmp_path) == []  # staging and lock file gone


# ----------------------------------------------------------------------------------------------------------
# 3. Leftovers: SIGKILL / SIGTERM mid-conversion, a failed final rename.
# ----------------------------------------------------------------------------------------------------------

# A writer killed mid-output. It runs `atomic_directory` (loaded from its file, without torch, so that it starts in
# milliseconds): what a conversion leaves on disk is what `atomic_directory` leaves.
_PAUSED_WRITER = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("atomic", sys.argv[1])
atomic = importlib.util.module_from_spec(spec)
spec.loader.exec_module(atomic)
with atomic.atomic_directory(sys.argv[2], expected=("config.json",)) as staging:
    (staging / "model-00001-of-00002.safetensors").write_bytes(bytes(1 << 20))
    print("READY", flush=True)
    time.sleep(120)
"""


# The command line, its conversion paused once its shards are written (the conversion of a tiny checkpoint is
# over before a signal could reach it otherwise).
_PAUSED_CLI = """
import sys, time
import modeling_diff.conversion.convert as convert
original = convert._convert_directory
def paused(*args):
    original(*args)
    print("READY", flush=True)
    time.sleep(120)
convert._convert_directory = paused
from modeling_diff.conversion.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_command_line_interrupted_says_so_in_one_line_and_leaves_nothing(src, tmp_path, sig):
    dst = tmp_path / "dst"
    process = subprocess.Popen([sys.executable, "-c", _PAUSED_CLI, "convert", str(src), str(dst), "--heads", "all",
                                "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "READY"
        process.send_signal(sig)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and err.strip() == "modeling-diff: interrupted; nothing was written", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# SIGTERM taken while the output replaces DST (deferred through the renames, as Ctrl-C would be).
_TERMINATED_IN_THE_RENAMES_CLI = """
import os, signal, sys
import modeling_diff.atomic as atomic
original = atomic._replace
def replace_then_terminate(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    original(*args)
atomic._replace = replace_then_terminate
from modeling_diff.conversion.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_command_line_interrupted_during_the_renames_says_the_output_was_written(src, tmp_path):
    """A signal taken while the new output replaced an earlier one waits for the renames, and then the output is
    in place: the line said "nothing was written" after DST had been replaced."""
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), "--heads", "all", "--quiet"]) == 0
    (dst / "config.json").write_text((dst / "config.json").read_text().replace("{", '{"earlier": 1,', 1))
    run = subprocess.run([sys.executable, "-c", _TERMINATED_IN_THE_RENAMES_CLI, "convert", str(src), str(dst),
                          "--heads", "all", "--quiet", "--overwrite"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 130 and run.stderr.strip() == (
        f"modeling-diff: interrupted; {str(dst)!r} had been written"), run.stderr
    assert "earlier" not in (dst / "config.json").read_text()  # the new output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]


def test_killed_and_terminated_writers_leave_nothing(src, tmp_path):
    """SIGTERM unwinds like Ctrl-C (staging and lock removed at once); after SIGKILL the next conversion to the same
    destination removes the dead process's staging directory."""
    import modeling_diff.atomic

    (tmp_path / "logs").mkdir()
    runs = {}
    for sig in (signal.SIGKILL, signal.SIGTERM):
        with open(tmp_path / "logs" / sig.name, "w") as log:
            runs[sig] = subprocess.Popen(
                [sys.executable, "-c", _PAUSED_WRITER, modeling_diff.atomic.__file__, str(tmp_path / sig.name)],
                stdout=subprocess.PIPE, stderr=log, text=True)
    for sig, process in runs.items():
        assert process.stdout.readline().strip() == "READY", (tmp_path / "logs" / sig.name).read_text()
        (staging,) = [p for p in tmp_path.iterdir() if p.name.startswith(f".{sig.name}.{process.pid}.")]
        assert staging.name.endswith(".tmp") and any(staging.glob("*.safetensors"))  # mid-output
        process.send_signal(sig)
    for process in runs.values():
        process.communicate(timeout=60)
        assert process.returncode != 0
    assert "KeyboardInterrupt: terminated by signal SIGTERM" in (tmp_path / "logs" / "SIGTERM").read_text()
    # SIGTERM cleaned up at once; SIGKILL left its staging directory and its (no longer locked) lock file.
    leftovers = hidden_leftovers(tmp_path)
    assert len(leftovers) == 2 and ".SIGKILL.lock" in leftovers
    assert [name for name in leftovers if name != ".SIGKILL.lock"][0].startswith(f".SIGKILL.{runs[signal.SIGKILL].pid}.")
    assert not (tmp_path / "SIGKILL").exists() and not (tmp_path / "SIGTERM").exists()

    convert_checkpoint(src, tmp_path / "SIGKILL", heads="all", progress=False)  # the rerun cleans up
    assert hidden_leftovers(tmp_path) == [] and (tmp_path / "SIGKILL" / "config.json").is_file()


def test_stale_staging_of_this_destination_is_removed_whatever_its_pid_and_another_destination_s_kept(src, tmp_path):
    """The lock held, every staging directory of DST is a dead writer's, even one named with this process's pid (a
    container's converter is PID 1 on every run); another destination's and other names are kept. A live writer's
    are never reached: it holds the lock (tests/test_atomic.py)."""
    own_pid = tmp_path / f".dst.{os.getpid()}.abcd1234.tmp"
    other = tmp_path / ".dst2.999999999.abcd1234.tmp"  # another destination's
    unrelated = tmp_path / ".dst.notes"
    dead = tmp_path / ".dst.999999999.abcd1234.old"
    for path in (own_pid, other, unrelated, dead):
        path.mkdir()
    convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert hidden_leftovers(tmp_path) == sorted(p.name for p in (other, unrelated))


def test_a_failed_final_rename_leaves_the_old_output_and_nothing_else(src, tmp_path, monkeypatch):
    dst = convert_checkpoint(src, tmp_path / "dst", heads=[0], progress=False)
    before = tree_hash(dst)
    rename = Path.rename

    def busy(self, target):
        if self == dst:  # moving a mount point away fails
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(self))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", busy)
    with pytest.raises(ValueError, match=r"could not be replaced \(is it a mount point\?\)"):
        convert_checkpoint(src, dst, heads=[1], overwrite=True, progress=False)
    assert tree_hash(dst) == before and hidden_leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------------------
# 4-6. Heads, symlinks, the working directory, what --overwrite may replace.
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,message", [("[true]", "not booleans"), ("[[true],[1],[0]]", "not booleans"),
                                           ("[]", "heads selects no head"), ("[[0],1,[2]]", "one such list per layer"),
                                           ("[0,", "--heads must be"),
                                           # a TypeError (unhashable) before: lists nested deeper, a dict
                                           ("[[[0]],[[0]],[[0]]]", "--heads must be"),
                                           ('[[0],[1],[{"a":1}]]', "--heads must be"),
                                           ('[[0],[1],["2"]]', "--heads must be")])
def test_bad_heads_on_the_command_line(src, tmp_path, capsys, heads, message):
    assert message in cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", heads], capsys)
    assert not (tmp_path / "dst").exists()


def test_links_out_of_the_source_are_skipped_with_a_warning(src, tmp_path, caplog):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)
    (src / "notes.txt").symlink_to("tokenizer_config.json")  # a link inside the source is followed
    with caplog.at_level(logging.WARNING, logger=convert_module.__name__):
        dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert "skipped tokenizer.json" in caplog.text and str(secret) in caplog.text
    assert not (dst / "tokenizer.json").exists()
    assert (dst / "notes.txt").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert not any(p.is_symlink() for p in dst.iterdir())


def test_a_hub_cache_snapshot_converts(pristine, tmp_path):
    """Snapshot files are relative links into the blob store of the same cache repository: they are followed."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for path in pristine.iterdir():
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copy(path, blobs / digest)
        (snapshot / path.name).symlink_to(Path("../../blobs") / digest)
    before = tree_hash(repo)
    dst = convert_checkpoint(snapshot, tmp_path / "dst", heads="all", progress=False)
    assert (dst / "tokenizer.json").read_bytes() == (pristine / "tokenizer.json").read_bytes()
    ids = token_ids()
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(dst).eval()(ids).logits
        assert (logits - tiny_llama()(ids).logits).abs().max() <= 1e-4
    assert tree_hash(repo) == before
    # the blobs are the snapshot's: as DST (even with --overwrite twice), or anything else in the repository folder
    for inside in (blobs, repo / "snapshots" / "other"):
        with pytest.raises(ValueError, match="must not be, contain or lie inside the source"):
            convert_checkpoint(snapshot, inside, heads="all", overwrite="force", progress=False)
    assert tree_hash(repo) == before


def test_the_working_directory_is_refused_as_destination(src, tmp_path, capsys, monkeypatch):
    out = tmp_path / "work" / "out"
    out.mkdir(parents=True)
    monkeypatch.chdir(out)
    for argv in (["."], [".", "--overwrite"], [str(tmp_path / "work"), "--overwrite", "--overwrite"]):
        line = cli_error(["convert", str(src), *argv, "--heads", "all"], capsys)
        assert "is (or contains) the current working directory" in line
    assert list(out.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["src", "work"]


@pytest.mark.parametrize("dst", ["link/out", "link"])
def test_a_destination_through_a_link_to_a_directory_is_written_where_the_link_leads(src, tmp_path, capsys, dst):
    """README: only a link to nothing is refused as (or above) DST; "a link to a directory is followed". `link/out`
    (`link -> elsewhere/real`) writes the output into `elsewhere/real/out`; `link` itself makes `elsewhere/real` the
    output, under DST's rules (empty: written; an earlier output: replaced only with --overwrite). The link stays a
    link to the same directory, and nothing is left beside it or the real directory (no staging, no lock)."""
    real = tmp_path / "elsewhere" / "real"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    assert main(["convert", str(src), str(tmp_path / dst), "--heads", "all", "--quiet"]) == 0
    written = real / "out" if dst == "link/out" else real
    assert json.loads((written / "config.json").read_text())["dex_heads"] == [[0, 1, 2, 3]] * 3
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / dst)) is DiffLlamaForCausalLM  # loads through the link
    capsys.readouterr()  # from_pretrained's progress bar
    if dst == "link":  # the real directory, now an earlier output, is replaced by the rules of any DST
        line = cli_error(["convert", str(src), str(tmp_path / dst), "--heads", "[0]"], capsys)
        assert "exists and is not empty; pass overwrite=True (--overwrite)" in line
        assert main(["convert", str(src), str(tmp_path / dst), "--heads", "[0]", "--overwrite", "--quiet"]) == 0
        assert json.loads((real / "config.json").read_text())["dex_heads"] == [[0]] * 3
    assert (tmp_path / "link").is_symlink() and (tmp_path / "link").resolve() == real
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link", "src"]
    assert hidden_leftovers(real) == [] and sorted(p.name for p in real.parent.iterdir()) == ["real"]


# ----------------------------------------------------------------------------------------------------------
# 8. Command-line inputs: one line, exit status 2, nothing written, before any expensive work.
# ----------------------------------------------------------------------------------------------------------


def _edit_config(src: Path, **fields) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(fields)
    (src / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "config_text,message",
    # empty: refused before it is read, as the files of /proc that report a size of 0 (/proc/kmsg hung a read)
    [("", "config.json in .* must be a regular file .* got an empty file, or one that reports no size \\(such as "
      "those of /proc\\)"), ("{garbage", "is not valid JSON"),
     ("null", "must hold a JSON object, got null"), ("[1, 2]", "must hold a JSON object"),
     (b"\xff\xfe", "is not valid JSON")],
)
def test_broken_config_json(src, tmp_path, capsys, config_text, message):
    path = src / "config.json"
    path.write_bytes(config_text) if isinstance(config_text, bytes) else path.write_text(config_text)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert re.search(message, line), line
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(hidden_act="swoosh"), "hidden_act must be one of"),
        # transformers' own Llama config refuses it in one line (5.25); where it does not (5.17), our own check
        (dict(head_dim=15), ("head_dim`=15", "head_dim must be even for rotary embeddings, got 15")),
        (dict(rms_norm_eps=0.0), "rms_norm_eps must be > 0"),
        (dict(rms_norm_eps=1e300), "rms_norm_eps must be > 0 and at most 1"),
        # transformers' Llama config only warns; our model's embedding asserted when it was built
        (dict(pad_token_id=300), "pad_token_id must be None, -1 or a token id in [0, 300), got 300"),
        (dict(model_type="gpt2"), "model_type must be one of"),
        (dict(hidden_size="64"), "hidden_size"),
        # convert exited 0, but the output did not load with dtype="auto" ("not a floating-point dtype")
        (dict(dtype="int8"), "config.json in {src!r}: dtype must be float32, float16 or bfloat16"),
        (dict(dtype=None, torch_dtype="int8"), "config.json in {src!r}: torch_dtype must be float32, float16 or "
                                               "bfloat16"),
        (dict(dtype="float8_e4m3fn"), "dtype must be float32, float16 or bfloat16 (what the output loads in"),
        # transformers' own Llama fails to build with it (a ZeroDivisionError); the converter read 0 as "absent"
        (dict(head_dim=0), "head_dim must be a positive integer, or absent"),
    ],
)
def test_bad_source_configs(src, tmp_path, capsys, fields, message):
    _edit_config(src, **fields)
    error = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    messages = message if isinstance(message, tuple) else (message,)  # either of the versions' messages
    assert any(text.format(src=str(src)) in error for text in messages), error
    assert not (tmp_path / "dst").exists()


def test_a_converted_model_given_again_as_the_source_is_told_so_first(tmp_path, capsys):
    """A DEX output converted again with the default (entropy) heads was told that it had no tokenizer for the
    calibration text; only with --heads all that a diff_llama is no source. The architecture is checked first."""
    src = tmp_path / "dex"
    DiffLlamaForCausalLM(preset_config("tiny-dex")).save_pretrained(src)
    capsys.readouterr()  # the progress bar of saving it
    line = cli_error(["convert", str(src), str(tmp_path / "dst")], capsys)
    assert "model_type must be one of ('llama', 'mistral', 'qwen2'), got 'diff_llama'" in line
    assert not (tmp_path / "dst").exists()


def test_destination_under_a_file_or_read_only(src, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    line = cli_error(["convert", str(src), str(tmp_path / "file" / "dst"), "--heads", "all"], capsys)
    assert "lies under" in line and "is not a directory" in line
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    with unwritable(read_only):
        line = cli_error(["convert", str(src), str(read_only / "dst"), "--heads", "all"], capsys)
        assert "cannot be written" in line and str(read_only / "dst") in line
    assert list(read_only.iterdir()) == []


def test_a_full_disk_is_one_line_and_leaves_nothing(src, tmp_path, capsys, monkeypatch):
    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(convert_module, "save_file", full)
    assert "No space left on device" in cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"],
                                                  capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("content", [b"GGUF\x03\x00\x00\x00" + bytes(8), b"", os.urandom(4096)])
def test_a_gguf_file_that_is_not_one_is_one_line(tmp_path, capsys, content):
    """A truncated header (what gguf's reader met with a struct.error traceback), an empty file, random bytes."""
    crafted = tmp_path / "model.gguf"
    crafted.write_bytes(content)
    line = cli_error(["convert", str(crafted), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert "is not a readable GGUF file" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


@pytest.mark.parametrize("block_count,layers,held", [
    (10**6, range(2), "2 layers (blk.0 to blk.1)"),
    (3, range(2), "2 layers (blk.0 to blk.1)"),
    (2, [0, 5], "2 layers, numbered up to 5 (no blk.1.* tensor)"),
    (1, [0, 10**12], "2 layers, numbered up to 1000000000000 (no blk.1.* tensor)"),  # was a set of 10**12 numbers
    (2, [0], "1 layer (blk.0 to blk.0)"),
])
def test_a_gguf_file_whose_block_count_is_not_its_layers_is_refused_before_loading(tmp_path, capsys, monkeypatch,
                                                                                  block_count, layers, held):
    """transformers builds the model its GGUF metadata describes before reading the tensors: a block_count of a
    million built a million layers (minutes, tens of GiB). Compared with the tensors first, in one line."""
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    crafted = write_gguf_header(tmp_path / "model.gguf", block_count, layers)
    line = cli_error(["convert", str(crafted), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert f"source GGUF file {str(crafted)!r}: llama.block_count is {block_count}, but its tensors hold {held}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_calibration_file_is_read_no_further_than_its_first_512_tokens_reach(src, tmp_path, monkeypatch):
    """A 3 GiB file was read whole (a MemoryError traceback), and a 200 MiB one made the tokenizer abort."""
    huge = tmp_path / "huge.txt"
    with open(huge, "w", encoding="utf-8") as file:
        file.write(TEXT * 400)  # 48 KB of text, then a sparse hole to 1 GiB (read as NULs)
        file.truncate(2**30)
    seen = []
    original = convert_module.calibration_ids_from
    monkeypatch.setattr(convert_module, "calibration_ids_from", lambda text, *a, **k: (
        seen.append(len(text)), original(text, *a, **k))[1])
    assert main(["convert", str(src), str(tmp_path / "dst"), "--calibration-file", str(huge), "--quiet"]) == 0
    assert seen and seen[0] <= 512 * convert_module.CHARS_PER_TOKEN_AT_MOST


def test_a_shard_or_tokenizer_that_is_a_fifo_is_named_as_such(pristine, src, tmp_path, capsys):
    """Refused before it is opened (a FIFO would be waited on), and called what it is, not "missing"."""
    shard = json.loads((src / INDEX).read_text())["weight_map"]["model.norm.weight"]
    (src / shard).unlink()
    os.mkfifo(src / shard)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert f"shard '{shard}'" in line and "is not a regular file" in line
    (src / shard).unlink()
    shutil.copy(pristine / shard, src / shard)
    (src / "tokenizer.json").unlink()
    os.mkfifo(src / "tokenizer.json")
    line = cli_error(["convert", str(src), str(tmp_path / "dst2")], capsys)
    assert "tokenizer.json in" in line and "must be a regular file" in line and "got not a regular file" in line


def test_a_tokenizer_linking_out_of_the_source_is_not_read_for_the_calibration(src, tmp_path, capsys):
    """Copying skips such a link with a warning; the calibration read it as the source's tokenizer."""
    outside = tmp_path / "elsewhere.json"
    (src / "tokenizer.json").rename(outside)
    (src / "tokenizer.json").symlink_to(outside)
    line = cli_error(["convert", str(src), str(tmp_path / "dst")], capsys)
    assert "tokenizer.json in" in line and "outside the checkpoint" in line
    assert not (tmp_path / "dst").exists()


def _sparse(path: Path, size: int = 3 << 30) -> None:
    """`path` as a file of `size` bytes that takes no disk (a hole)."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as file:
        file.truncate(size)


@pytest.fixture
def no_output_or_tokenizer(monkeypatch):
    """The checks must come before the tokenizer is read and before the destination is touched."""
    def refuse(*args, **kwargs):
        raise AssertionError("read or written before the source's files were checked")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(convert_module, "atomic_directory", refuse)


TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "spm.model", "tokenizer.4.0.0.json",
                   "additional_chat_templates/tool_use.jinja",
                   # the rest of README's list: every file transformers 5.x's AutoTokenizer reads whole
                   "tekken.json", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json", "added_tokens.json", "tokenizer.model"]


@pytest.mark.parametrize("name,heads", [
    *((name, []) for name in TOKENIZER_FILES),  # read whole by the calibration's tokenizer
    *((name, ["--heads", "all"]) for name in [*TOKENIZER_FILES, "generation_config.json"]),  # copied: DST would not load
])
def test_a_tokenizer_or_generation_config_of_gigabytes_is_refused_before_it_is_read(
        src, tmp_path, capsys, no_output_or_tokenizer, name, heads):
    """transformers reads these whole: 3 GiB ended in a MemoryError (or was copied into an output that could not
    load). A SentencePiece model of another name, a versioned tokenizer and a named chat template were not checked.
    README promises the refusal, in one line with exit status 2 and no DST, for each tokenizer file it lists."""
    (src / name).parent.mkdir(exist_ok=True)
    _sparse(src / name)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), *heads], capsys)
    assert f"{Path(name).name} in {str((src / name).parent)!r} must be a regular file of at most 67108864 bytes" in line
    assert f"got {3 << 30} bytes" in line and not (tmp_path / "dst").exists()


def test_a_versioned_tokenizer_named_outside_the_source_is_not_read_for_the_calibration(src, tmp_path, capsys):
    """transformers reads tokenizer_config.json's `fast_tokenizer_files` entry by a name relative to SRC, `..`
    included: the calibration read another folder's tokenizer as the source's."""
    (tmp_path / "other").mkdir()
    shutil.copy(src / "tokenizer.json", tmp_path / "other" / "tokenizer.4.0.0.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "fast_tokenizer_files": ["../other/tokenizer.4.0.0.json"]}))
    line = cli_error(["convert", str(src), str(tmp_path / "dst")], capsys)
    assert f"../other/tokenizer.4.0.0.json in {str(src)!r} leads to" in line and "outside the checkpoint" in line
    assert not (tmp_path / "dst").exists()


def test_a_versioned_tokenizer_named_outside_the_source_is_dropped_from_the_copied_tokenizer_config(
        src, tmp_path, caplog):
    """Without calibration text nothing reads the tokenizer: its tokenizer_config.json was copied unchanged, so the
    output's `fast_tokenizer_files` named `../other/tokenizer.4.1.0.json`, read by transformers relative to DST as
    the output's own tokenizer. The entry is dropped with a warning, as a link out is skipped; entries inside stay."""
    (tmp_path / "other").mkdir()
    shutil.copy(src / "tokenizer.json", tmp_path / "other" / "tokenizer.4.1.0.json")
    shutil.copy(src / "tokenizer.json", src / "tokenizer.4.0.0.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    names = ["tokenizer.4.0.0.json", "../other/tokenizer.4.1.0.json"]
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "fast_tokenizer_files": names}))
    before = tree_hash(src)
    with caplog.at_level(logging.WARNING, logger=convert_module.__name__):
        dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert "dropped ../other/tokenizer.4.1.0.json from fast_tokenizer_files" in caplog.text
    assert "outside the source checkpoint" in caplog.text
    assert json.loads((dst / "tokenizer_config.json").read_text()) == {**config, "fast_tokenizer_files": names[:1]}
    assert (dst / "tokenizer.4.0.0.json").is_file() and tree_hash(src) == before
    assert AutoTokenizer.from_pretrained(dst)(TEXT).input_ids == AutoTokenizer.from_pretrained(src)(TEXT).input_ids


@pytest.mark.parametrize("name", ["versions/tokenizer.4.0.0.json", "./versions/../versions/tokenizer.4.0.0.json"])
def test_a_versioned_tokenizer_in_a_subfolder_is_carried_under_a_plain_name(src, tmp_path, name):
    """transformers reads the `fast_tokenizer_files` entry for its version relative to the folder, a subfolder's
    included: convert copied the top level and the chat templates only, so the output named a file it lacked and
    loaded another tokenizer than the source's. The file is carried; the entry is written without `.` or `..`."""
    (src / "versions").mkdir()
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({**tokenizer["added_tokens"][-1], "id": tokenizer["added_tokens"][-1]["id"] + 1,
                                      "content": "<|versioned|>"})  # tells the versioned file from tokenizer.json
    (src / "versions" / "tokenizer.4.0.0.json").write_text(json.dumps(tokenizer))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "fast_tokenizer_files": [name]}))
    text = TEXT + " <|versioned|>"
    source_tokenizer = AutoTokenizer.from_pretrained(src)
    assert "<|versioned|>" in source_tokenizer.get_vocab()  # the source reads the versioned file
    expected = source_tokenizer(text).input_ids
    dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert json.loads((dst / "tokenizer_config.json").read_text())["fast_tokenizer_files"] == [
        "versions/tokenizer.4.0.0.json"]
    assert (dst / "versions" / "tokenizer.4.0.0.json").read_bytes() == (
        src / "versions" / "tokenizer.4.0.0.json").read_bytes()
    assert AutoTokenizer.from_pretrained(dst)(text).input_ids == expected


def test_fast_tokenizer_files_naming_the_config_or_weights_do_not_replace_the_converted_ones(src, tmp_path):
    """The files `fast_tokenizer_files` names are carried into the output: an entry naming `config.json`, the index
    or a weights file (transformers ignores a name that is not `tokenizer.<version>.json`) must not be copied over
    the converted model."""
    config = json.loads((src / "tokenizer_config.json").read_text())
    names = ["config.json", "model.safetensors", INDEX, "./config.json", "sub/../model.safetensors"]
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "fast_tokenizer_files": names}))
    dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert AutoConfig.from_pretrained(dst).model_type == "diff_llama"
    assert sorted(p.name for p in dst.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX) == sorted(
        p.name for p in src.iterdir() if p.name.endswith(".safetensors") or p.name == INDEX)  # no weights added
    model = AutoModelForCausalLM.from_pretrained(dst)
    assert type(model) is DiffLlamaForCausalLM and model.config.diff_mode == "dex"


@pytest.mark.parametrize("text,message", [
    ("{garbage", "tokenizer_config.json in {src!r} is not valid JSON"),
    ('{"fast_tokenizer_files": "tokenizer.4.0.0.json"}', "fast_tokenizer_files must be a list of file names"),
    ('{"fast_tokenizer_files": ["tokenizer.4.0.0.json\\u0000"]}', "fast_tokenizer_files must be a list of file names"),
    # valid JSON, but not an object (README: "a tokenizer_config.json that is not a JSON object ... is refused")
    ("[1]", "tokenizer_config.json in {src!r} must hold a JSON object, got [1]"),
    ("null", "tokenizer_config.json in {src!r} must hold a JSON object, got null"),
    ("3", "tokenizer_config.json in {src!r} must hold a JSON object, got 3"),
    ('"x"', 'tokenizer_config.json in {src!r} must hold a JSON object, got "x"'),
])
@pytest.mark.parametrize("heads", [["--heads", "all"], []])  # copied only; read by the calibration's tokenizer too
def test_a_tokenizer_config_the_output_could_not_load_is_refused_before_it_is_copied(src, tmp_path, capsys, text,
                                                                                     message, heads):
    """Its `fast_tokenizer_files` are read to drop the entries leading out: one that cannot be read, or a
    tokenizer_config.json that is valid JSON but no object, is one line with exit status 2, and no DST (whether
    it is only copied or also read for the calibration text)."""
    (src / "tokenizer_config.json").write_text(text)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), *heads], capsys)
    assert message.format(src=str(src)) in line and not (tmp_path / "dst").exists()


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_a_config_or_index_linking_out_of_the_source_is_refused(src, tmp_path, capsys, name):
    """The config (or index) of another model, linked from SRC, was read as SRC's: its size was checked, not where it
    leads. Refused in one line as a link out is, before DST is touched."""
    other = Path(shutil.copytree(src, tmp_path / "other"))
    (src / name).unlink()
    (src / name).symlink_to(other / name)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert f"{name} in {str(src)!r} leads to {str(other / name)!r}" in line and "outside the checkpoint" in line
    assert not (tmp_path / "dst").exists()


def test_named_chat_templates_are_carried(src, tmp_path, caplog):
    """A tokenizer's named chat templates live in additional_chat_templates/: the conversion lost them (it copied the
    top folder's files only). A template in it that links out of SRC is skipped with a warning, as at the top."""
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": "{{ tools | length }} tools"}
    tokenizer.save_pretrained(src)
    assert (src / "additional_chat_templates" / "tool_use.jinja").is_file()
    dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    assert AutoTokenizer.from_pretrained(dst).chat_template == AutoTokenizer.from_pretrained(src).chat_template
    assert set(AutoTokenizer.from_pretrained(dst).chat_template) == {"default", "tool_use"}
    (tmp_path / "secret.jinja").write_text("root:x:0:0")
    (src / "additional_chat_templates" / "secret.jinja").symlink_to(tmp_path / "secret.jinja")
    with caplog.at_level(logging.WARNING, logger=convert_module.__name__):
        dst = convert_checkpoint(src, tmp_path / "dst2", heads="all", progress=False)
    assert "skipped additional_chat_templates/secret.jinja" in caplog.text
    assert sorted(p.name for p in (dst / "additional_chat_templates").iterdir()) == ["tool_use.jinja"]


@pytest.mark.parametrize("name", ["tokenizer_config.json", "additional_chat_templates/tool_use.jinja"])
def test_a_tokenizer_config_of_gigabytes_next_to_a_gguf_file_is_refused(tmp_path, capsys, no_output_or_tokenizer, name):
    """AutoTokenizer reads the tokenizer_config.json and the named chat templates next to a .gguf file whole."""
    from gguf import GGUFWriter

    writer = GGUFWriter(tmp_path / "model.gguf", "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / name).parent.mkdir(exist_ok=True)
    _sparse(tmp_path / name)
    line = cli_error(["convert", str(tmp_path / "model.gguf"), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert f"{Path(name).name} in" in line and f"got {3 << 30} bytes" in line
    assert not (tmp_path / "dst").exists()


def run_cli(argv: list) -> str:
    """The command line in a new process, `argv` holding bytes as a shell passes a name that is not UTF-8. It must exit
    with status 2 and one error line (no traceback); returns that line."""
    result = subprocess.run([sys.executable, "-c", "import sys; from modeling_diff.conversion.cli import main; "
                             "sys.exit(main())", *argv], capture_output=True, timeout=300)
    err = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("command", ["convert", "export"])
@pytest.mark.parametrize("which", ["src", "dst"])
def test_a_path_that_is_not_utf8_is_one_line(pristine, tmp_path, command, which):
    """safetensors opens UTF-8 paths only, and tokenizers writes to them only. A DST that is not UTF-8: convert wrote
    an output no one could load (and printing its name failed where stdout is strict), export failed after the model
    loaded with "surrogates not allowed". A SRC: "not a readable safetensors file"."""
    source = tmp_path / "src"
    if command == "convert":
        shutil.copytree(pristine, source)
    else:
        convert_checkpoint(pristine, source, heads="all", progress=False)
    bad = tmp_path / os.fsdecode(b"not-utf8-\xff")
    if which == "src":
        source = source.rename(bad)
    dst = bad if which == "dst" else tmp_path / "dst"
    options = ["--heads", "all", "--quiet"] if command == "convert" else []
    line = run_cli([command, os.fsencode(source), os.fsencode(dst), *options])
    assert f"{os.fsencode(bad)!r} is not valid UTF-8" in line, line
    assert [p.name for p in tmp_path.iterdir()] == [source.name]


def test_calibration_inputs(src, tmp_path, capsys):
    dst = str(tmp_path / "dst")
    (tmp_path / "latin1.txt").write_bytes("Thou art more lovely, café".encode("latin-1"))
    assert "is not UTF-8 text" in cli_error(["convert", str(src), dst, "--calibration-file",
                                             str(tmp_path / "latin1.txt")], capsys)
    (tmp_path / "sonnet.txt").write_text(TEXT)
    (src / "tokenizer.json").unlink()  # tokenizer_config.json stays: it holds no vocabulary
    line = cli_error(["convert", str(src), dst, "--calibration-file", str(tmp_path / "sonnet.txt")], capsys)
    assert "calibration text needs the source's tokenizer" in line and "tokenizer.json" in line
    assert "sentencepiece" not in line.lower() and not (tmp_path / "dst").exists()


def test_calibration_ids_beyond_the_vocabulary(tmp_path, capsys):
    src = tmp_path / "src"
    tiny_llama(vocab_size=100).save_pretrained(src)
    byte_tokenizer().save_pretrained(src)  # ids up to 255 >= vocab_size 100
    (tmp_path / "sonnet.txt").write_text(TEXT)
    capsys.readouterr()  # save_pretrained's progress bars
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--calibration-file", str(tmp_path / "sonnet.txt")],
                     capsys)
    assert "calibration token ids must lie in [0, vocab_size=100)" in line


@pytest.mark.parametrize("fraction", ["0", "1.5", "nan", "-1"])
def test_head_fraction_is_refused_before_the_calibration(src, tmp_path, capsys, monkeypatch, fraction):
    def never(*args, **kwargs):
        raise AssertionError("the calibration ran before the arguments were checked")

    monkeypatch.setattr(convert_module, "attention_entropy", never)
    monkeypatch.setattr(convert_module, "CheckpointDir", never)  # not even the source is read
    (tmp_path / "sonnet.txt").write_text(TEXT)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--head-fraction", fraction,
                      "--calibration-file", str(tmp_path / "sonnet.txt")], capsys)
    assert "head_fraction must be in (0, 1]" in line and not (tmp_path / "dst").exists()


@pytest.fixture
def never_opened(monkeypatch):
    """`never_opened(path)`: opening `path` (built-in open or os.open) fails the test instead of blocking on it."""
    import builtins

    refused, real_open, real_os_open = set(), builtins.open, os.open

    def guard(path):
        if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path) in refused:
            raise AssertionError(f"{path} was opened before it was checked")

    def open_(file, *args, **kwargs):
        guard(file)
        return real_open(file, *args, **kwargs)

    def os_open(path, *args, **kwargs):
        guard(path)
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    return lambda path: refused.add(os.fsdecode(path))


@pytest.mark.parametrize("name,rule", [("/proc/kmsg", "reports no size"), ("/proc/self/mem", "reports no size"),
                                       ("empty.txt", "is empty")])
def test_a_calibration_file_that_is_no_regular_file_with_a_size_is_refused_before_it_is_opened(
        src, tmp_path, capsys, never_opened, name, rule):
    """procfs files pass `is_file()` with a size of 0: reading /proc/kmsg blocked for ever, /proc/self/mem was an
    OSError traceback (EIO). A calibration file is a regular file of text: one line naming --calibration-file."""
    path = Path(name) if name.startswith("/") else tmp_path / name
    if name == "empty.txt":
        path.touch()
    never_opened(path)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--calibration-file", str(path)], capsys)
    assert f"--calibration-file {str(path)!r}" in line and "must be a regular file of text" in line and rule in line
    assert not (tmp_path / "dst").exists()


def test_a_calibration_file_that_cannot_be_read_is_one_line(src, tmp_path, capsys, monkeypatch):
    """An OSError while reading (a disk error, EIO) was a traceback: only UnicodeDecodeError was caught."""
    import modeling_diff.text_files as text_files

    (tmp_path / "sonnet.txt").write_text(TEXT)

    class FailingRead:  # the file opened as the command line opens it, whose read fails as a bad disk's does
        def __init__(self, *args, **kwargs):
            self.file = open(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.file.close()

        def fileno(self):
            return self.file.fileno()

        def read(self, *args):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(text_files, "open", FailingRead, raising=False)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--calibration-file", str(tmp_path / "sonnet.txt")],
                     capsys)
    assert "--calibration-file" in line and "cannot be read" in line and "Input/output error" in line


# ----------------------------------------------------------------------------------------------------------
# 9. A config.json at odds with the tensors is refused before any model is built from it.
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["convert", "export"])
@pytest.mark.parametrize("layers,held", [(1_000_000, "3 layers (model.layers.0 to model.layers.2)"),
                                         (2, "3 layers (model.layers.0 to model.layers.2)"),
                                         (0, "3 layers (model.layers.0 to model.layers.2)"),
                                         (1_000_000, "4 layers, numbered up to 999999 (no model.layers.3.* tensor)")])
def test_num_hidden_layers_other_than_the_checkpoints_is_refused_before_anything_is_built(
        pristine, tmp_path, capsys, monkeypatch, command, layers, held):
    """1,000,000 layers: convert built the model on the meta device before comparing the shard headers with the
    config (many minutes, tens of GiB; 20,000 layers took 20 s and 1.5 GiB before being refused as "missing"
    tensors), and export loaded it. The layer indices in the shard headers are compared with num_hidden_layers first;
    a shard naming one tensor of the last layer claimed does not make up the layers in between."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    if command == "convert":
        shutil.copytree(pristine, src)
    else:
        convert_checkpoint(pristine, src, heads="all", progress=False)
    _edit_config(src, num_hidden_layers=layers)
    if "999999" in held:
        name = "model.layers.999999.input_layernorm.weight"
        save_file({name: torch.ones(64)}, src / "model-extra.safetensors")
        index = json.loads((src / INDEX).read_text())
        index["weight_map"][name] = "model-extra.safetensors"
        (src / INDEX).write_text(json.dumps(index))

    def never(*args, **kwargs):
        raise AssertionError("a model or config was built before the layers were compared with the checkpoint's")

    monkeypatch.setattr(convert_module, "AutoConfig", never)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    before = tree_hash(src)
    line = cli_error([command, str(src), str(tmp_path / "dst"), *(["--heads", "all"] if command == "convert" else [])],
                     capsys, quiet=command == "convert")
    assert f"config.json in {str(src)!r}: num_hidden_layers is {layers}, but its tensors hold {held}" in line
    assert tree_hash(src) == before and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ----------------------------------------------------------------------------------------------------------
# 9b. The source is what transformers loads: its weight file, its tying. The converted model keeps the logits of
#     `from_pretrained(SRC)`, whatever else the folder holds.
# ----------------------------------------------------------------------------------------------------------


def _logits(model, ids=None) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(token_ids() if ids is None else ids).logits


def _loaded(path: Path):
    return AutoModelForCausalLM.from_pretrained(path)


def test_a_tied_config_whose_checkpoint_holds_another_lm_head_converts_untied(tmp_path, caplog):
    """tie_word_embeddings=true in config.json, and an lm_head.weight of other values in the checkpoint: transformers
    loads the two untied (with a warning). The converter dropped lm_head.weight and tied the output to the embedding:
    other logits (by 1.3), exit status 0. Both paths now keep both, untied, and say so."""
    src = tmp_path / "src"
    tiny_llama().save_pretrained(src)  # untied
    _edit_config(src, tie_word_embeddings=True)
    source = _loaded(src)
    assert source.lm_head.weight is not source.model.embed_tokens.weight  # transformers' reading of it
    with caplog.at_level(logging.WARNING, logger="modeling_diff.conversion.mapping"):
        dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
        in_memory = convert_model(source, heads="all", progress=False)
    assert sum("converted untied, as transformers loads the source" in r.getMessage() for r in caplog.records) == 2
    converted = _loaded(dst)
    assert not converted.config.tie_word_embeddings and not in_memory.config.tie_word_embeddings
    torch.testing.assert_close(_logits(converted), _logits(source), rtol=0, atol=0)
    torch.testing.assert_close(_logits(in_memory), _logits(source), rtol=0, atol=0)


def test_a_tied_checkpoint_holding_the_same_lm_head_stays_tied(tmp_path):
    """Checkpoints saved with torch's .bin writer hold both names of the tied tensor: equal values, still tied."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    tiny_llama("llama-mqa-tied-bias").save_pretrained(src)
    state = load_file(src / "model.safetensors")
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, src / "model.safetensors",
              metadata={"format": "pt"})
    converted = _loaded(convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False))
    assert converted.config.tie_word_embeddings and converted.lm_head.weight is converted.model.embed_tokens.weight
    torch.testing.assert_close(_logits(converted), _logits(_loaded(src)), rtol=0, atol=0)


def test_a_model_safetensors_beside_an_index_is_the_source_as_for_transformers(pristine, tmp_path, capsys):
    """transformers loads model.safetensors before an index; the converter read the index's shards: (a) another
    model's weights converted (logits off by 1.0), exit 0; (b) an index naming model.safetensors as one of its shards
    gave an output of which from_pretrained loaded one shard, 23 tensors left random, exit 0."""
    src = Path(shutil.copytree(pristine, tmp_path / "src"))
    tiny_llama(seed=1).save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "model.safetensors", src / "model.safetensors")
    dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    torch.testing.assert_close(_logits(_loaded(dst)), _logits(_loaded(src)), rtol=0, atol=0)
    assert not (dst / INDEX).exists()  # one file, as the source transformers loads

    first = json.loads((src / INDEX).read_text())["weight_map"]["model.embed_tokens.weight"]
    (src / "model.safetensors").unlink()
    (src / first).rename(src / "model.safetensors")
    _rename_in_index(src, first, "model.safetensors")
    capsys.readouterr()  # save_pretrained's and from_pretrained's progress bars
    line = cli_error(["convert", str(src), str(tmp_path / "dst2"), "--heads", "all"], capsys)
    assert "num_hidden_layers is 3, but its tensors hold 1 layer" in line and not (tmp_path / "dst2").exists()


def plant_code(folder: Path, marker: Path, what: str) -> None:
    """An `auto_map` in `folder`'s config.json (`what` "config", with a model_type transformers does not know) or in
    its tokenizer_config.json ("tokenizer") naming a module of `folder`'s, which writes `marker` when imported."""
    code = f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\nimport transformers\n"
    if what == "config":
        _edit_config(folder, model_type="planted_llama", auto_map={"AutoConfig": "planted.PlantedConfig"})
        code += "class PlantedConfig(transformers.LlamaConfig):\n    model_type = 'planted_llama'\n"
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(tokenizer_class="PlantedTokenizer",
                      auto_map={"AutoTokenizer": [None, "planted.PlantedTokenizer"]})
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        code += "class PlantedTokenizer(transformers.PreTrainedTokenizerFast):\n    pass\n"
    (folder / "planted.py").write_text(code)


@pytest.mark.parametrize("what", ["config", "tokenizer"])
def test_code_in_the_source_is_never_run_even_answered_yes(src, tmp_path, capsys, monkeypatch, what):
    """An auto_map in the source's config.json or tokenizer_config.json made transformers ask on the terminal whether
    to run the source's Python, and a "y" ran it (before the model type was refused, or while the calibration's
    tokenizer loaded): the source is only read. Refused in one line, whatever the answer."""
    marker = tmp_path / "ran"
    plant_code(src, marker, what)
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    line = cli_error(["convert", str(src), str(tmp_path / "dst")], capsys)  # heads by entropy: the tokenizer loads
    assert "contains custom code" in line and str(src) in line, line
    assert not marker.exists() and not (tmp_path / "dst").exists()


def test_bad_inputs_for_a_gguf_source_are_refused_before_it_is_dequantised(tmp_path, capsys, monkeypatch):
    """The heads (a list for another number of layers, an index out of range) were checked only after the whole
    model had been dequantised (25 s for SmolLM2-135M), beside a staging directory in DST's folder; now against the
    file's metadata first, as for a folder."""
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    write_gguf_header(gguf / "model.gguf", 2, range(2), shapes=True)
    for heads, message in (("[[0],[1],[2]]", "one such list per layer (2)"), ("9", "in [0, 4)")):
        line = cli_error(["convert", str(gguf / "model.gguf"), str(tmp_path / "dst"), "--heads", heads], capsys)
        assert message in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gguf"]


@pytest.mark.parametrize("fields,message", [
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),  # was "modulo by zero"
    ({"num_key_value_heads": -2}, "num_key_value_heads must be a positive integer, got -2"),
])
def test_head_counts_are_checked_before_transformers_divides_by_them(src, tmp_path, capsys, fields, message):
    _edit_config(src, **fields)
    assert message in cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)


def test_a_generation_config_that_is_no_json_object_is_refused_not_carried(src, tmp_path, capsys):
    """A JSON list was copied as it was, exit 0, and the output did not load ("'list' object is not a mapping")."""
    (src / "generation_config.json").write_text("[1, 2]")
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert "generation_config.json in" in line and "must hold a JSON object" in line
    assert not (tmp_path / "dst").exists()


def test_an_index_named_in_config_json_listing_a_model_safetensors_shard_converts_to_the_sources_logits(
        pristine, tmp_path):
    """config.json's transformers_weights names an index of another name, one of whose shards is called
    model.safetensors (transformers loads it so): the output's shards kept the source's names, and from_pretrained
    loaded its model.safetensors alone beside its index (one layer's tensors left random), exit 0. The output's
    files now have save_pretrained's names, and the source's index is not carried."""
    src = Path(shutil.copytree(pristine, tmp_path / "src"))
    first = json.loads((src / INDEX).read_text())["weight_map"]["model.embed_tokens.weight"]
    (src / first).rename(src / "model.safetensors")
    _rename_in_index(src, first, "model.safetensors")
    (src / INDEX).rename(src / "weights.safetensors.index.json")
    _edit_config(src, transformers_weights="weights.safetensors.index.json")
    source = _loaded(src)
    dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    count = len(set(json.loads((src / "weights.safetensors.index.json").read_text())["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(p.name for p in dst.glob("*.json") if "safetensors" in p.name) == [INDEX]
    converted, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"]
    torch.testing.assert_close(_logits(converted), _logits(source), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["weights.safetensors", "weights.safetensors.index.json"])
def test_transformers_weights_in_config_json_names_the_source(pristine, tmp_path, name):
    """config.json's `transformers_weights` names the file from_pretrained loads instead of model.safetensors (or the
    index): the converter converted model.safetensors."""
    src = Path(shutil.copytree(pristine, tmp_path / "src"))
    tiny_llama(seed=1).save_pretrained(tmp_path / "other")
    if name.endswith(".json"):
        (src / INDEX).rename(src / name)
        shutil.copy(tmp_path / "other" / "model.safetensors", src / "model.safetensors")  # not the source
    else:
        shutil.copy(tmp_path / "other" / "model.safetensors", src / name)  # the source, beside the index
    _edit_config(src, transformers_weights=name)
    source = _loaded(src)
    dst = convert_checkpoint(src, tmp_path / "dst", heads="all", progress=False)
    torch.testing.assert_close(_logits(_loaded(dst)), _logits(source), rtol=0, atol=0)


@pytest.mark.parametrize("value,message", [
    ("../other/model.safetensors", "transformers_weights must be the plain name of a .safetensors file"),
    ("sub/model.safetensors", "transformers_weights must be the plain name of a .safetensors file"),
    ("model.bin", "transformers_weights must be the plain name of a .safetensors file"),
    (5, "transformers_weights must be the plain name of a .safetensors file"),
    ("outside.safetensors", "is a link to"),
])
def test_a_crafted_transformers_weights_is_refused(pristine, tmp_path, capsys, value, message):
    src = Path(shutil.copytree(pristine, tmp_path / "src"))
    tiny_llama(seed=1).save_pretrained(tmp_path / "other")
    (src / "outside.safetensors").symlink_to(tmp_path / "other" / "model.safetensors")
    _edit_config(src, transformers_weights=value)
    capsys.readouterr()  # save_pretrained's progress bars
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert message in line, line
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("argv", [["--method", "v2"], ["--heads", "all"], ["--heads", "0,1"]])
def test_a_calibration_file_where_no_heads_are_chosen_by_entropy_is_refused(src, tmp_path, capsys, argv):
    """--method v2 with --calibration-file failed on a source without a tokenizer ("calibration text needs the
    source's tokenizer"), and with one the file was read and ignored; --heads with v2 was refused. (In Python an
    unused calibration is left unread: `test_an_unused_calibration_text_needs_no_tokenizer`.)"""
    (tmp_path / "sonnet.txt").write_text(TEXT)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), *argv, "--calibration-file",
                      str(tmp_path / "sonnet.txt")], capsys)
    assert "--calibration-file applies to --method dex with --heads entropy (the default) only" in line
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("method,heads", [("v2", None), ("dex", "all")])
def test_an_unused_calibration_text_needs_no_tokenizer(src, tmp_path, method, heads):
    (src / "tokenizer.json").unlink()
    dst = convert_checkpoint(src, tmp_path / "dst", method=method, heads=heads, calibration=TEXT, progress=False)
    assert json.loads((dst / "config.json").read_text())["diff_mode"] == method


def test_a_calibration_text_of_one_token_is_refused_naming_it(src, tmp_path, capsys):
    (tmp_path / "one.txt").write_text("A")  # one byte: one token of the byte-level tokenizer
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--calibration-file", str(tmp_path / "one.txt")],
                     capsys)
    assert "calibration text (--calibration-file) must give at least 2 tokens with the source's tokenizer" in line


def test_non_finite_weights_are_refused_by_the_entropy_selection(tmp_path, capsys):
    """topk ranks NaN highest: the heads of a layer whose attention is NaN were chosen arbitrarily, exit 0. With the
    heads chosen, the tensor itself is refused (`test_non_finite_weights_are_refused_naming_the_tensor`)."""
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="the attention of layer 1 is not finite"):
        convert_model(model, calibration=token_ids(), progress=False)
    with pytest.raises(ValueError, match="tensor 'model.layers.1.self_attn.q_proj.weight' in the source model holds "
                                         "NaN or inf values"):
        convert_model(model, heads="all", progress=False)


# ----------------------------------------------------------------------------------------------------------
# 10. The demo (`make demo`): its flags are checked before the model loads; it replaces an output only when told.
# ----------------------------------------------------------------------------------------------------------


def demo_error(argv: list[str], capsys) -> str:
    """Run the demo, which must exit with status 2 and a one-line error before it loads anything; return the line."""
    from modeling_diff.conversion import demo

    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("usage:", " "))]
    assert len(lines) == 1 and ": error: " in lines[0], err
    return lines[0]


@pytest.fixture
def demo_never_loads(monkeypatch):
    from modeling_diff.conversion import demo

    def never():
        raise AssertionError("the demo loaded its model before its flags were checked")

    monkeypatch.setattr(demo, "load_smollm2", never)


@pytest.mark.parametrize("flag,value,message", [
    ("--head-fraction", "0", "--head-fraction must be in (0, 1], got 0.0"),
    ("--head-fraction", "nan", "--head-fraction must be in (0, 1], got nan"),
    ("--seq-len", "0", "--seq-len must be an integer >= 2, got 0"),
    ("--seq-len", "1", "--seq-len must be an integer >= 2, got 1"),
    ("--steps", "0", "--steps must be an integer >= 1, got 0"),
    ("--batch-size", "-1", "--batch-size must be an integer >= 1, got -1"),
    ("--eval-blocks", "0", "--eval-blocks must be an integer >= 1, got 0"),
    ("--new-tokens", "0", "--new-tokens must be an integer >= 1, got 0"),
    ("--anneal-steps", "-1", "--anneal-steps must be an integer in [0, 2**31), got -1"),
    ("--anneal-steps", str(2**31), f"--anneal-steps must be an integer in [0, 2**31), got {2**31}"),
    ("--lr", "0", "--lr must be a finite number > 0, got 0.0"),
    ("--lr", "inf", "--lr must be a finite number > 0, got inf"),
    ("--seq-len", "100000", "--steps x --batch-size x --seq-len = 3200000 tokens of training text"),
    ("--eval-blocks", "100000", "--eval-blocks x --seq-len = 6400000 tokens of held-out text"),
])
def test_the_demos_flags_are_checked_before_the_model_loads(capsys, demo_never_loads, flag, value, message):
    """--head-fraction 0 and --seq-len 0 were ValueError tracebacks after the model loaded."""
    assert message in demo_error([flag, value], capsys)


def _tiny_smollm2():
    """The demo's model and tokenizer, tiny: a random 3-layer Llama and a byte-level tokenizer (ids < 300)."""
    return tiny_llama(), byte_tokenizer()


def test_the_demo_replaces_an_existing_output_only_with_overwrite(tmp_path, capsys, monkeypatch, demo_never_loads):
    """`--output precious_ckpt` silently replaced an existing checkpoint folder (its NOTES.txt was gone, rc 0). As
    convert's DST: refused up front in one line; one --overwrite replaces an earlier output (a config.json in it),
    twice any folder."""
    from modeling_diff.conversion import demo

    precious, other = tmp_path / "precious_ckpt", tmp_path / "thesis"
    for folder, file in ((precious, "config.json"), (precious, "NOTES.txt"), (other, "thesis.tex")):
        folder.mkdir(exist_ok=True)
        (folder / file).write_text("{}" if file == "config.json" else "precious")
    before = tree_hash(tmp_path)
    line = demo_error(["--output", str(precious)], capsys)
    assert f"--output {str(precious)!r} exists and is not empty; pass overwrite=True (--overwrite)" in line
    line = demo_error(["--output", str(other), "--overwrite"], capsys)
    assert "holds no config.json" in line and "--overwrite twice" in line
    assert "is not a directory" in demo_error(["--output", str(other / "thesis.tex" / "x")], capsys)
    assert tree_hash(tmp_path) == before

    # --overwrite: the demo runs (tiny) and replaces the earlier output with its model
    monkeypatch.setattr(demo, "load_smollm2", _tiny_smollm2)
    small = ["--steps", "1", "--anneal-steps", "1", "--batch-size", "1", "--seq-len", "16", "--eval-blocks", "1",
             "--new-tokens", "2"]
    result = demo.main([*small, "--output", str(precious), "--overwrite"])
    assert result["same_tokens"] and not (precious / "NOTES.txt").exists()
    assert AutoConfig.from_pretrained(precious).model_type == "diff_llama"
    assert hidden_leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------------------
# 11. A source is what from_pretrained(SRC) loads, read by the rules above, or it is refused in one line: a PEFT
#     adapter beside the weights, non-finite weights, a tokenizer that does not load or encode, options of
#     another kind of source.
# ----------------------------------------------------------------------------------------------------------


def export_error(argv: list[str], capsys) -> str:
    """`modeling-diff export ARGV`, which must exit with status 2 and one error line; returns that line."""
    return cli_error(["export", *argv], capsys, quiet=False)


def _save_lora(model, folder: Path) -> Path:
    """A non-zero LoRA of `model` saved into `folder` as PEFT saves one (adapter_config.json and
    adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model

    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
                   ).save_pretrained(folder)
    return folder


def _link_in(folder: Path, files: Path) -> None:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / name).symlink_to(files / name)


@pytest.mark.parametrize("where", ["saved into SRC", "linked from outside SRC"])
def test_a_source_holding_a_peft_adapter_is_refused_before_anything_is_written(src, tmp_path, capsys, where):
    """`PeftModel.save_pretrained(SRC)` leaves adapter_config.json and adapter_model.safetensors next to the model:
    from_pretrained(SRC) applies the adapter. The converter converted the weights alone (other logits than
    from_pretrained(SRC)) and carried adapter_config.json without the adapter's weights, exit 0: DST did not load.
    Refused by name, the adapter's files never read (linked in, they lead anywhere)."""
    if where == "saved into SRC":
        _save_lora(AutoModelForCausalLM.from_pretrained(src), src)
    else:
        _link_in(src, _save_lora(AutoModelForCausalLM.from_pretrained(src), tmp_path / "lora"))
    before, _ = tree_hash(src), capsys.readouterr()  # the progress bars of saving it
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert f"{str(src)!r} holds a PEFT adapter (adapter_config.json)" in line and "merge_and_unload()" in line, line
    assert not (tmp_path / "dst").exists() and tree_hash(src) == before


def test_export_of_a_source_holding_a_peft_adapter_is_refused_before_it_is_read(pristine, tmp_path, capsys):
    """export read the adapter linked into SRC (transformers' PEFT lookup) and failed on PEFT's version, or with a
    missing staging config.json once PEFT's version passed."""
    src = convert_checkpoint(pristine, tmp_path / "dex", heads="all", progress=False)
    _link_in(src, _save_lora(AutoModelForCausalLM.from_pretrained(src), tmp_path / "lora"))
    capsys.readouterr()  # the progress bars of saving it
    line = export_error([str(src), str(tmp_path / "out")], capsys)
    assert "holds a PEFT adapter (adapter_config.json)" in line and "merge_and_unload()" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["/proc/self/status", "a diffllama config"])
def test_a_config_json_linking_out_of_the_source_is_refused_before_it_is_read(src, tmp_path, capsys, monkeypatch,
                                                                             target):
    """Telling a transformers diffllama source from a Llama, the converter read config.json before the checks that it
    is a regular file inside SRC: `config.json -> /proc/kmsg` (a regular file of size 0, read forever) hung it. The
    read of a config.json outside SRC fails here instead of hanging. /proc/self/status is such a file too (a regular
    file reporting size 0) on every Linux machine, where /proc/kmsg is not in every container; read, it only does
    not block."""
    if target == "a diffllama config":
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "diffllama"}))
        target = tmp_path / "other" / "config.json"
    read_text = Path.read_text

    def checked_read_text(path, *args, **kwargs):
        if path.name == "config.json" and not path.resolve().is_relative_to(src.resolve()):
            raise AssertionError(f"{path} was read before it was checked")
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", checked_read_text)
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(target)
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert "config.json in" in line and "outside the checkpoint" in line, line
    assert not (tmp_path / "dst").exists()


def test_a_gguf_file_without_tokenizer_metadata_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A .gguf whose tokenizer.ggml.* metadata is missing: a KeyError('tokens') traceback, after the whole model was
    dequantised. The tokenizer now loads first (from the metadata, in a moment), and its failure is one line."""
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    crafted = write_gguf_header(tmp_path / "model.gguf", 2, range(2))
    line = cli_error(["convert", str(crafted), str(tmp_path / "dst"), "--heads", "all"], capsys)
    assert f"the tokenizer in {str(tmp_path)!r} (model.gguf) could not be loaded from the file's tokenizer.ggml.* " \
           f"metadata" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_export_of_a_tokenizer_json_that_tokenizers_rejects_is_one_line(pristine, tmp_path, capsys):
    """The Rust tokenizers library raises a bare Exception for JSON it does not take: a traceback, exit status 1."""
    src = convert_checkpoint(pristine, tmp_path / "dex", heads="all", progress=False)
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    (src / "tokenizer.json").write_text(json.dumps({**tokenizer, "model": {"type": "Nope"}}))
    line = export_error([str(src), str(tmp_path / "out")], capsys)
    assert f"the tokenizer in {str(src)!r} (tokenizer.json" in line and "could not be loaded: Exception: " in line
    assert not (tmp_path / "out").exists()


def test_a_calibration_text_the_tokenizer_cannot_encode_is_one_line(tmp_path, capsys):
    """A WordLevel tokenizer whose unk_token is not in its vocabulary loads, and fails on the first unknown word:
    tokenizers' bare Exception was a traceback (the default conversion, on the packaged text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    src = tmp_path / "src"
    tiny_llama().save_pretrained(src)
    backend = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(src)
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    del tokenizer["model"]["vocab"]["<unk>"]
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    capsys.readouterr()  # the progress bars of saving it
    line = cli_error(["convert", str(src), str(tmp_path / "dst")], capsys)
    assert "calibration text (--calibration-file, or the packaged text) could not be tokenised with the source's " \
           "tokenizer: Exception: " in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.fixture
def diffllama_src(tmp_path):
    """A transformers `diffllama` checkpoint (it converts to an exact V1, every head kept)."""
    from transformers import DiffLlamaConfig as TransformersDiffLlamaConfig
    from transformers import DiffLlamaForCausalLM as TransformersDiffLlamaForCausalLM

    torch.manual_seed(0)
    TransformersDiffLlamaForCausalLM(TransformersDiffLlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(tmp_path / "diffllama")
    return tmp_path / "diffllama"


@pytest.mark.parametrize("option,value", [("--head-fraction", "0.25"), ("--anneal-steps", "5"),
                                          ("--calibration-file", "sonnet.txt")])
def test_options_of_a_llama_source_are_refused_for_a_diffllama_source(diffllama_src, tmp_path, capsys, option,
                                                                       value):
    """--head-fraction and --anneal-steps were ignored, exit 0, as if applied; --calibration-file asked for a
    tokenizer for a text the conversion never used."""
    (tmp_path / "sonnet.txt").write_text(TEXT)
    value = str(tmp_path / value) if option == "--calibration-file" else value
    line = cli_error(["convert", str(diffllama_src), str(tmp_path / "dst"), option, value], capsys)
    assert f"({option}) given, but method and heads must be left unset to convert 'diffllama' to 'diff_llama'" in line
    assert "V1 does not anneal" in line and not (tmp_path / "dst").exists()
    with pytest.raises(ValueError, match=r"anneal_steps \(--anneal-steps\) given"):
        convert_checkpoint(diffllama_src, tmp_path / "dst", anneal_steps=1000, progress=False)


@pytest.mark.parametrize("tensor,value,argv", [
    ("lm_head.weight", float("nan"), []),  # the entropy calibration never reaches it
    ("model.norm.weight", float("inf"), ["--heads", "all"]),
    ("model.layers.0.self_attn.q_proj.weight", float("nan"), ["--method", "v2"]),
])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, capsys, tensor, value, argv):
    """Converted silently (exit 0) wherever no entropy calibration ran through them: the output's logits were NaN."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    tiny_llama().save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    state = load_file(src / "model.safetensors")
    state[tensor][0, ...] = value
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # the progress bars of saving it
    line = cli_error(["convert", str(src), str(tmp_path / "dst"), *argv], capsys)
    assert f"tensor {tensor!r} in model.safetensors holds NaN or inf values" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_tied_checkpoint_holding_only_lm_head_converts_as_transformers_loads_it(tmp_path):
    """tie_word_embeddings=true and only lm_head.weight stored (no model.embed_tokens.weight): transformers loads that
    tensor as the embedding both share; the converter refused the source ("model.embed_tokens.weight missing")."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    tiny_llama("llama-mqa-tied-bias").save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    state = load_file(src / "model.safetensors")
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    source = _loaded(src)
    converted = _loaded(convert_checkpoint(src, tmp_path / "dst", progress=False))  # entropy heads: read as loaded
    assert converted.config.tie_word_embeddings and converted.lm_head.weight is converted.model.embed_tokens.weight
    torch.testing.assert_close(_logits(converted), _logits(source), rtol=0, atol=0)
