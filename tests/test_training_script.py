"""examples/train.py (and the demo, and modeling_diff.data) as a user meets them: the trained model is saved with its
tokenizer, whole or not at all (a kill mid-save, Ctrl-C, SIGTERM), an earlier output replaced only with --overwrite;
unwritable outputs and non-finite checkpoints refused before training, in one line."""

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from ecosystem_helpers import PYTHON, REPO, byte_tokenizer, offline_env, save_byte_llama
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from modeling_diff import DiffLlamaForCausalLM, data, preset_config
from modeling_diff.data import text_blocks

TRAIN = str(REPO / "examples" / "train.py")
FAST = ["--max-steps", "1", "--seq-len", "16", "--batch-size", "2"]
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 20


def env(tmp_path: Path) -> dict:
    """offline_env, with the system's temporary folder under tmp_path (train.py's scratch folder goes there)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return offline_env(tmp_path, TMPDIR=str(tmp_path / "tmp"))


def train(tmp_path: Path, *extra, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, TRAIN, *FAST, *extra], cwd=tmp_path, env=env(tmp_path), capture_output=True,
                          text=True, timeout=timeout)


def train_with_save_hook(tmp_path: Path, hook: str, *extra) -> subprocess.CompletedProcess:
    """train.py with the safetensors writer of transformers' save_pretrained replaced: it writes a cut-short weights
    file, then runs `hook` (Python code: kills or signals this very process) -- an interruption mid-save, exactly."""
    code = (
        "import os, runpy, signal, sys\n"
        "import transformers.modeling_utils as modeling_utils\n"
        "def cut_short(tensors, filename, metadata=None):\n"
        "    with open(filename, 'wb') as file:\n"
        "        file.write(b'half a weights file')\n"
        f"    {hook}\n"
        "modeling_utils.safe_save_file = cut_short\n"
        f"sys.argv = [{TRAIN!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({TRAIN!r}, run_name='__main__')\n"
    )
    return subprocess.run([PYTHON, "-c", code, *FAST, *extra], cwd=tmp_path, env=env(tmp_path), capture_output=True,
                          text=True, timeout=300)


def error_line(out: subprocess.CompletedProcess) -> str:
    """The one line of a refusal: exit status 2, no traceback, nothing after it (a message over several lines was)."""
    assert out.returncode == 2 and "Traceback" not in out.stderr, (out.returncode, out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and out.stderr.rstrip().splitlines()[-1] == errors[0], out.stderr[-3000:]
    assert "trained " not in out.stdout
    return errors[0]


# ------------------------------------------------------------------------------------------------ the tokenizer


@pytest.mark.parametrize("source", ["--tokenizer", "the checkpoint's"])
def test_the_trained_model_is_saved_with_the_tokenizer_it_was_trained_with(tmp_path, source):
    """No tokenizer was saved into --output-dir: `modeling-diff eval --model_args pretrained=OUT` found none, and
    `modeling-diff export OUT` carried none."""
    tokenizer = byte_tokenizer()
    if source == "--tokenizer":
        tokenizer.save_pretrained(tmp_path / "tokenizer")
        model = ["--model", "tiny-v1", "--tokenizer", str(tmp_path / "tokenizer")]
    else:
        DiffLlamaForCausalLM(preset_config("tiny-v1", vocab_size=len(tokenizer))).save_pretrained(tmp_path / "ckpt")
        tokenizer.save_pretrained(tmp_path / "ckpt")
        model = ["--model", str(tmp_path / "ckpt")]
    (tmp_path / "train.txt").write_text(TEXT)
    out = train(tmp_path, *model, "--text-file", "train.txt", "--output-dir", "out")
    assert out.returncode == 0, out.stderr[-3000:]
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    sample = "Whether 'tis nobler, café — ünïcödé\n"
    assert saved(sample).input_ids == tokenizer(sample).input_ids and saved.eos_token == tokenizer.eos_token
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(trained) is DiffLlamaForCausalLM
    assert trained.config.vocab_size == len(tokenizer) == 257
    if source == "--tokenizer":  # a preset's vocabulary is the tokenizer's: tiny-v1's 256 did not hold its EOS, 256
        assert trained.config.eos_token_id == trained.config.pad_token_id == tokenizer.eos_token_id == 256
    batch = saved(["To be", "or not to be"], return_tensors="pt", padding=True)  # padded with EOS
    assert trained.generate(**batch, max_new_tokens=2, do_sample=False).shape == (2, batch.input_ids.shape[1] + 2)


def test_a_checkpoint_whose_vocabulary_lacks_an_id_of_the_tokenizer_is_refused(tmp_path):
    """A tokenizer whose EOS (id 256) lies beyond a checkpoint's vocabulary of 256 trained (the text's ids were all
    bytes) and was saved with the model; its first EOS or padding then indexed past the embedding. One line, exit
    status 2, before the model is built."""
    byte_tokenizer().save_pretrained(tmp_path / "tokenizer")
    DiffLlamaForCausalLM(preset_config("tiny-v1")).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "train.txt").write_text(TEXT)
    line = error_line(train(tmp_path, "--model", str(tmp_path / "ckpt"), "--tokenizer", str(tmp_path / "tokenizer"),
                            "--text-file", "train.txt", "--output-dir", "out"))
    assert ("--tokenizer has token id 256 ('<|endoftext|>'), beyond the model's vocab_size 256: the tokenizer must "
            "be the model's (--tokenizer)") in line, line
    assert not (tmp_path / "out").exists()
    # The same bytes without special tokens fit: trained and saved (a tokenizer with none was a TypeError)
    no_special = byte_tokenizer(special=False)
    assert no_special.all_special_ids == [] and len(no_special) == 256
    no_special.save_pretrained(tmp_path / "bytes")
    out = train(tmp_path, "--model", str(tmp_path / "ckpt"), "--tokenizer", str(tmp_path / "bytes"), "--text-file",
                "train.txt", "--output-dir", "out")
    assert out.returncode == 0, out.stderr[-3000:]


# -------------------------------------------------------------------------------- the save: whole or not at all


def test_a_kill_during_the_save_leaves_no_output_and_a_rerun_leaves_no_leftovers(tmp_path):
    """Trainer wrote into --output-dir file by file: SIGKILL mid-save left a config.json without (whole) weights,
    which a rerun refused as an earlier output and from_pretrained could not load. It also left Trainer's empty
    scratch folder in the system's temporary folder, one for each killed run."""
    runs = tmp_path / "runs"
    runs.mkdir()
    out = train_with_save_hook(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)", "--model", "tiny-v1",
                               "--output-dir", str(runs / "out"))
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert not (runs / "out").exists()  # what the killed writer staged is hidden, and removed by the next one
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing in $TMPDIR: Trainer's scratch folder lived only while
    # Trainer was being built
    out = train(tmp_path, "--model", "tiny-v1", "--output-dir", str(runs / "out"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert [p.name for p in runs.iterdir()] == ["out"]  # no staging folder, no lock file
    assert type(AutoModelForCausalLM.from_pretrained(runs / "out")) is DiffLlamaForCausalLM


def test_an_earlier_output_is_replaced_whole_and_only_with_overwrite(tmp_path):
    """With --overwrite Trainer wrote over the earlier output file by file: whatever the new model did not write again
    (another run's weights shards, notes) stayed in it, mixed with the new model."""
    earlier = tmp_path / "out"
    DiffLlamaForCausalLM(preset_config("tiny-v1")).save_pretrained(earlier)
    (earlier / "NOTES.txt").write_text("the earlier run")
    before = {p.name: p.read_bytes() for p in earlier.iterdir()}
    line = error_line(train(tmp_path, "--model", "tiny-v1", "--output-dir", "out"))
    assert "--output-dir" in line and "exists and is not empty; pass overwrite=True (--overwrite)" in line
    assert {p.name: p.read_bytes() for p in earlier.iterdir()} == before
    out = train(tmp_path, "--model", "tiny-v1", "--output-dir", "out", "--overwrite")
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (earlier / "NOTES.txt").exists()
    assert (earlier / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_an_output_dir_made_by_someone_else_during_the_run_is_left_as_it_is(tmp_path):
    """--output-dir checked at the start and created by another process before the save ends: the run is refused in
    one line, that folder untouched, nothing of this run left (Trainer once wrote into whatever was there)."""
    hook = "os.makedirs('out'); open('out/theirs.txt', 'w').write('another run')"
    line = error_line(train_with_save_hook(tmp_path, hook, "--model", "tiny-v1", "--output-dir", "out"))
    assert "--output-dir" in line and "was created by someone else while this one was being written" in line, line
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["theirs.txt"]
    assert (tmp_path / "out" / "theirs.txt").read_text() == "another run"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ------------------------------------------------------------------------------------------------- interruptions


def test_ctrl_c_during_training_says_so_in_one_line_and_saves_nothing(tmp_path):
    """Ctrl-C was a KeyboardInterrupt traceback (exit status 1) that left the empty --output-dir Trainer had made."""
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        process = subprocess.Popen([PYTHON, TRAIN, "--model", "tiny-v1", "--max-steps", "100000", "--seq-len", "16",
                                    "--batch-size", "2", "--output-dir", "out"], cwd=tmp_path, env=env(tmp_path),
                                   stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 120
            while "/100000 [" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)  # until the training loop runs
            assert not (tmp_path / "out").exists()  # Trainer's own folder is not --output-dir
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=60) == 130, log.read_text()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
    err = log.read_text()
    assert "Traceback" not in err and "train.py: interrupted; nothing was saved to --output-dir 'out'" in err, err
    assert not (tmp_path / "out").exists() and list((tmp_path / "tmp").iterdir()) == []


def test_sigterm_during_the_save_says_so_in_one_line_and_leaves_nothing(tmp_path):
    """SIGTERM (a scheduler's) killed the script with status -15 and half an output in --output-dir."""
    out = train_with_save_hook(tmp_path, "os.kill(os.getpid(), signal.SIGTERM)", "--model", "tiny-v1",
                               "--output-dir", "out")
    assert out.returncode == 130 and "Traceback" not in out.stderr, (out.returncode, out.stderr[-3000:])
    assert out.stderr.rstrip().splitlines()[-1] == "train.py: interrupted; nothing was saved to --output-dir 'out'"
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert list((tmp_path / "tmp").iterdir()) == []  # Trainer's scratch folder removed too


# ----------------------------------------------------------------------------------- refused before training


def test_an_output_dir_that_cannot_be_written_is_refused_before_training(tmp_path):
    """Under /proc (read-only even for root), --output-dir was a traceback from Trainer's makedirs, after the model
    was built (an immutable folder: after the training, when the model was saved)."""
    line = error_line(train(tmp_path, "--model", "tiny-v1", "--output-dir", "/proc/modeling-diff-out"))
    assert "train.py: error: --output-dir '/proc/modeling-diff-out' cannot be written: " in line, line


def test_a_tokenizer_that_does_not_load_is_one_line(tmp_path):
    """--tokenizer naming a folder without tokenizer files (a model's): transformers' message, over 5 lines."""
    DiffLlamaForCausalLM(preset_config("tiny-v1")).save_pretrained(tmp_path / "model-only")
    line = error_line(train(tmp_path, "--model", "tiny-v1", "--tokenizer", str(tmp_path / "model-only"),
                            "--output-dir", "out"))
    assert f"the tokenizer in {str(tmp_path / 'model-only')!r}" in line and "could not be loaded" in line, line
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_with_non_finite_weights_is_refused_before_training(tmp_path):
    """A --model whose weights hold NaN was trained for the whole run, then blamed on --learning-rate."""
    from safetensors.torch import load_file, save_file

    checkpoint = tmp_path / "nan-model"
    DiffLlamaForCausalLM(preset_config("tiny-v1")).save_pretrained(checkpoint)
    tensors = load_file(checkpoint / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] = math.inf
    tensors["model.norm.weight"][0] = math.nan  # after it: the first is named
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    line = error_line(train(tmp_path, "--model", str(checkpoint), "--output-dir", "out"))
    assert f"--model {str(checkpoint)!r}: tensor {name!r} holds NaN or inf values" in line, line
    assert "learning-rate" not in line and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------------ the demo


def test_the_demo_saves_nothing_when_training_diverges(tmp_path, monkeypatch, capsys):
    """`make demo`'s script with --lr 1e6 saved NaN weights to --output and exited 0."""
    from modeling_diff.conversion import demo

    save_byte_llama(tmp_path / "llama")
    monkeypatch.setattr(demo, "load_smollm2", lambda: (LlamaForCausalLM.from_pretrained(tmp_path / "llama"),
                                                       byte_tokenizer()))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--steps", "2", "--anneal-steps", "1", "--batch-size", "1", "--seq-len", "16",
                   "--eval-blocks", "1", "--new-tokens", "2", "--lr", "1e30", "--output", str(tmp_path / "out")])
    message = str(exit_info.value.code)
    assert exit_info.value.code not in (0, None) and "\n" not in message
    assert message.startswith("training diverged: ") and "(--lr 1e+30 too high?); nothing saved" in message
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ modeling_diff.data


@pytest.mark.parametrize("argument", ["length", "count", "offset"])
@pytest.mark.parametrize("value", [2.5, math.nan, True])
def test_text_blocks_refuses_sizes_that_are_not_integers(argument, value):
    """2.5 and NaN failed late with a TypeError from slicing; True was taken as 1."""
    sizes = {"length": 4, "count": 2, "offset": 0, argument: value}
    with pytest.raises(ValueError, match=rf"^{argument} must be an integer, got {re.escape(repr(value))}$"):
        text_blocks(byte_tokenizer(), TEXT, **sizes)


def test_load_smollm2_names_a_copy_whose_tokenizer_json_is_damaged(tmp_path, monkeypatch):
    """A tokenizer.json that is JSON but no tokenizer raised the tokenizers library's bare Exception, where README
    promises a ValueError naming the folder to delete."""
    def never(*args, **kwargs):
        raise AssertionError("load_smollm2 converted the GGUF file")

    monkeypatch.setattr(data, "_save_smollm2_copy", never)
    copy = tmp_path / data.SMOLLM2_COPY
    torch.manual_seed(0)
    save_byte_llama(copy)
    tokenizer_json = json.loads((copy / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(json.dumps({**tokenizer_json, "model": {"type": "Nope"}}))
    with pytest.raises(ValueError, match=rf"the SmolLM2 cache {re.escape(repr(str(copy)))} holds an incomplete or "
                                         rf"damaged copy \(.+\): delete that folder"):
        data.load_smollm2(tmp_path)
    assert os.path.isdir(copy)  # named, not removed
