"""`python -m modeling_diff.needle`'s output and interruptions, attacked: a run killed (SIGKILL) or terminated
(SIGTERM) while its results were staged left a hidden staging folder next to --out for ever; Ctrl-C or SIGTERM
between the two renames into an existing --out, or two runs at once, mixed one run's needle.json with another's
needle.png; the --out it created was private (0700); Ctrl-C ended in a traceback and exit status 1; a model with NaN
weights or logits exited 0 ("mean 0.000") with a needle.json that was not JSON; errors named the Python parameters
(num_needles) instead of the flags typed (--needles)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ecosystem_helpers import byte_tokenizer, tiny_config
from safetensors.torch import load_file, save_file
from test_needle import HAYSTACK
from test_reliability_tools import model_dir, needle_error, no_model_loading  # noqa: F401  (fixtures)

import modeling_diff.needle as needle
from modeling_diff import DiffLlamaForCausalLM
from modeling_diff.atomic import locked_staging

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def haystack(tmp_path) -> Path:
    path = tmp_path / "haystack.txt"
    path.write_text(HAYSTACK)
    return path


def argv(model, haystack, out, *extra) -> list[str]:
    return [str(model), "--lengths", "256", "--depths", "0.5", "--haystack", str(haystack), "--out", str(out), *extra]


@pytest.fixture
def sigterm_raises():
    """SIGTERM raised as Ctrl-C while the test runs: a needle that ignored SIGTERM (the code before the fix) would
    otherwise kill pytest itself instead of failing the test."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, previous)


def run_main(args, capsys) -> tuple[int, list[str]]:
    """needle.main's exit status and stderr lines; a KeyboardInterrupt escaping it fails the test (not the run)."""
    try:
        needle.main(args)
        code = 0
    except KeyboardInterrupt:
        pytest.fail("the interruption escaped needle.main (a traceback, exit status 1)")
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_run_killed_while_staging_leaves_nothing_behind_the_next_run(model_dir, haystack, tmp_path, capsys, sig):
    """Killed as needle.png is written into the staging folder: SIGTERM removes it at once (exit 130, one line);
    the folder a SIGKILL leaves is removed by the next run to that --out (it held the lock, now free)."""
    parent = tmp_path / "results"
    parent.mkdir()
    out = parent / "out"
    script = (
        "import os, signal, sys\n"
        "import matplotlib.figure\n"
        "import modeling_diff.needle as needle\n"
        "save = matplotlib.figure.Figure.savefig\n"
        "def save_then_die(self, *args, **kwargs):\n"
        "    save(self, *args, **kwargs)\n"
        f"    os.kill(os.getpid(), signal.{sig})\n"
        "    import time; time.sleep(30)\n"
        "matplotlib.figure.Figure.savefig = save_then_die\n"
        f"needle.main({argv(model_dir, haystack, out)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    if sig == "SIGTERM":
        assert done.returncode == 130, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines()[-1] == "python -m modeling_diff.needle: interrupted; nothing was written"
        assert list(parent.iterdir()) == []  # no staging, no lock file, no --out
        return
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert [p for p in parent.iterdir() if p.name.startswith(".")]  # the killed run's staging (and lock file)
    code, err = run_main(argv(model_dir, haystack, out), capsys)
    assert code == 0, err
    assert [p.name for p in parent.iterdir()] == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["needle.json", "needle.png"]


def test_a_live_writers_staging_is_never_removed_and_its_lock_is_waited_for(model_dir, haystack, tmp_path, capsys,
                                                                           monkeypatch):
    """Another writer of --out holds its lock (and a staging folder): its staging is left alone; past the wait the
    results are kept beside --out, and the error says so. Before, the run wrote into --out regardless."""
    out = tmp_path / "out"
    monkeypatch.setattr(needle, "LOCK_WAIT_SECONDS", 0.3, raising=False)
    with locked_staging(out, "--out") as live:
        (live / "needle.json").write_text("{}")
        line = needle_error(argv(model_dir, haystack, out), capsys)
        assert f"--out {str(out)!r} is being written by another process" in line, line
        assert (live / "needle.json").read_text() == "{}" and not out.exists()
        kept = Path(line.split("the results are kept in ")[1].split("'")[1])
        assert kept.parent == tmp_path and not kept.name.startswith(".")
        assert sorted(p.name for p in kept.iterdir()) == ["needle.json", "needle.png"]
        assert kept.stat().st_mode & 0o777 == 0o755
        (live / "needle.json").unlink()  # (as a writer that moved its files into --out leaves its staging)
    assert not live.exists()

    # A writer that finishes within the wait is waited for: the results then go into --out.
    monkeypatch.setattr(needle, "LOCK_WAIT_SECONDS", 30.0, raising=False)
    lock = locked_staging(out, "--out")
    lock.__enter__()
    timer = threading.Timer(0.5, lock.__exit__, (None, None, None))
    timer.start()
    try:
        code, err = run_main(argv(model_dir, haystack, out), capsys)
    finally:
        timer.join()
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["needle.json", "needle.png"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interruption_between_the_renames_into_an_existing_out_waits_for_both(model_dir, haystack, tmp_path,
                                                                                capsys, monkeypatch, sigterm_raises,
                                                                                sig):
    """Ctrl-C or SIGTERM right after needle.json was renamed into an existing --out left it beside the earlier
    run's needle.png (and a traceback). Now both are renamed, then the interruption is reported: exit 130."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("needle.json", "needle.png", "other-results.txt"):
        (out / name).write_text("earlier")
    replace = Path.replace
    calls = []

    def replace_then_interrupt(self, target):
        moved = replace(self, target)
        calls.append(target)
        if len(calls) == 1:
            signal.raise_signal(sig)
        return moved

    monkeypatch.setattr(Path, "replace", replace_then_interrupt)
    code, err = run_main(argv(model_dir, haystack, out), capsys)
    assert code == 130, err
    assert err[-1] == (f"python -m modeling_diff.needle: interrupted; {out / 'needle.json'} and "
                       f"{out / 'needle.png'} had been written"), err
    assert json.loads((out / "needle.json").read_text())["lengths"] == [256]
    assert (out / "needle.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "other-results.txt").read_text() == "earlier"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["haystack.txt", "out"]


def test_the_out_folder_created_has_the_usual_mode(model_dir, haystack, tmp_path, capsys):
    """It was mkdtemp's staging folder renamed into place: 0700, unreadable to the group (a shared results tree)."""
    previous = os.umask(0o022)
    try:
        code, err = run_main(argv(model_dir, haystack, tmp_path / "new" / "out"), capsys)
    finally:
        os.umask(previous)
    assert code == 0, err
    assert (tmp_path / "new" / "out").stat().st_mode & 0o777 == 0o755


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM"])
def test_an_interrupted_evaluation_is_one_line_and_exit_status_130(model_dir, haystack, tmp_path, capsys,
                                                                  monkeypatch, sigterm_raises, how):
    """Ctrl-C printed a traceback and exited 1 (SIGTERM killed it without a word); now one line, as convert does."""
    def interrupted(model, prompt):
        if how == "Ctrl-C":
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGTERM)
        time.sleep(5)

    monkeypatch.setattr(needle, "score_prompt", interrupted)
    code, err = run_main(argv(model_dir, haystack, tmp_path / "out"), capsys)
    assert code == 130
    assert not [line for line in err if "Traceback" in line or "KeyboardInterrupt" in line], err
    assert err[-1] == "python -m modeling_diff.needle: interrupted; nothing was written"
    assert [p.name for p in tmp_path.iterdir()] == ["haystack.txt"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_model_with_non_finite_weights_is_refused_before_any_cell(model_dir, haystack, tmp_path, capsys,
                                                                   monkeypatch, value):
    """Its logits are NaN: every needle was scored missed, exit 0, "mean 0.000", and needle.json held bare NaN."""
    model = tmp_path / "nan-model"
    model.mkdir()
    for path in model_dir.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    weights = load_file(model / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name].clone()
    weights[name][0, 0] = value
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})

    def no_cell(*args, **kwargs):
        raise AssertionError("a cell ran")

    monkeypatch.setattr(needle, "score_prompt", no_cell)
    line = needle_error(argv(model, haystack, tmp_path / "out"), capsys)
    assert f"model {str(model)!r} holds NaN or inf weights (first in tensor {name!r})" in line, line
    assert not (tmp_path / "out").exists()


def test_non_finite_logits_stop_the_evaluation_and_write_nothing(model_dir, haystack, tmp_path, capsys, monkeypatch):
    """Finite weights, NaN logits (an overflow): refused at the first cell instead of a needle.json holding NaN."""
    monkeypatch.setattr(needle, "score_prompt", lambda model, prompt: (False, float("nan")))
    line = needle_error(argv(model_dir, haystack, tmp_path / "out"), capsys)
    assert "the model's logits hold NaN or inf values (context length 256, depth 0.5)" in line, line
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="logits hold NaN or inf"):  # the API refuses them too
        needle.evaluate_needles(DiffLlamaForCausalLM(tiny_config("v2", max_position_embeddings=512)),
                                byte_tokenizer(), [256], [0.5], haystack=HAYSTACK, progress=False)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--needles", "0"], "--needles must be in [1, 30], got 0"),
        (["--needles", "2", "--queries", "3"], "--queries must be in [1, --needles=2], got 3"),
        (["--trials", "0"], "--trials must be >= 1, got 0"),
        (["--lengths", "0"], "--lengths must be a non-empty list of positive integers, got [0]"),
        (["--depths", "2"], "--depths must be a non-empty list of fractions in [0, 1], got [2.0]"),
    ],
)
def test_errors_name_the_flags_typed(model_dir, tmp_path, capsys, no_model_loading, extra, message):  # noqa: F811
    line = needle_error([str(model_dir), "--out", str(tmp_path / "out"), *extra], capsys)
    assert line.endswith(f"error: {message}"), line
    with pytest.raises(ValueError, match="num_queries must be in"):  # the Python API keeps its parameter names
        needle.check_grid(None, [0.5], 2, 3, 1)


def test_lengths_beyond_the_model_name_the_flag(model_dir, tmp_path, capsys):
    line = needle_error([str(model_dir), "--out", str(tmp_path / "out"), "--lengths", "4096"], capsys)
    assert line.endswith("error: --lengths must not exceed max_position_embeddings (512), got 4096"), line
    line = needle_error([str(model_dir), "--out", str(tmp_path / "out")], capsys)  # was "start (1024) must not ..."
    assert line.endswith("error: --lengths must be given: the default starts at 1024 tokens, above the model's "
                         "max_position_embeddings (512)"), line
