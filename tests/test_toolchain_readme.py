"""The README's end-to-end training snippet runs as written: a Llama checkpoint -> DEX -> LoRA training with
Trainer and AnnealingCallback -> a merged model that `modeling-diff export` writes as a remote-code folder."""

import json
import re
import subprocess
from pathlib import Path

from ecosystem_helpers import PYTHON, offline_env, save_byte_llama
from transformers import AutoModelForCausalLM

from modeling_diff.conversion.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet(name: str) -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split("<!-- section:toolchain -->")[1].split("<!-- /section:toolchain -->")[0]
    match = re.search(rf"<!-- snippet:{name} -->\s*```python\n(.*?)```", section, re.DOTALL)
    assert match, f"README toolchain section has no snippet {name!r}"
    return match.group(1)


def bash_line(start: str) -> str:
    """The command of the toolchain section's bash block that starts with `start`."""
    text = README.read_text(encoding="utf-8")
    section = text.split("<!-- section:toolchain -->")[1].split("<!-- /section:toolchain -->")[0]
    (line,) = [line for line in section.splitlines() if line.startswith(start)]
    return line


def my_llama(folder: Path) -> None:
    """`my-llama` (a tiny random Llama with a byte tokenizer) and `train.txt` in `folder`."""
    save_byte_llama(folder / "my-llama")
    (folder / "train.txt").write_text((README.read_text(encoding="utf-8")[:2000] + "\n") * 2)


def test_the_end_to_end_commands_convert_and_train_with_examples_train_py(tmp_path, monkeypatch):
    """Steps 1 and 3 as written, with 2 optimizer steps instead of 1000."""
    my_llama(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(bash_line("modeling-diff convert my-llama ").split()[1:] + ["--quiet"]) == 0
    train = bash_line("python examples/train.py ").split()[1:]
    train[train.index("--max-steps") + 1] = "2"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([PYTHON, str(root / train[0]), *train[1:]], check=True, cwd=tmp_path, env=offline_env(tmp_path))
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "my-dex-trained")
    assert trained.config.diff_mode == "dex" and trained.config.anneal_steps == 500
    assert all(int(layer.self_attn.anneal_step) == 2 for layer in trained.model.layers)


def test_the_end_to_end_snippet_trains_the_dex_parameters_and_exports(tmp_path, monkeypatch):
    my_llama(tmp_path)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet("train"), "README.md", "exec"), {})

    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "my-dex")
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "my-dex-trained")
    assert trained.config.diff_mode == "dex" and trained.config.anneal_steps == 4
    for before, after in zip(converted.model.layers, trained.model.layers):
        assert int(after.self_attn.anneal_step) == 8  # t = the optimizer steps taken
        assert not before.self_attn.dex_proj.weight.any() and after.self_attn.dex_proj.weight.any()  # f_D learned
    assert main(["export", "my-dex-trained", "my-dex-hub", "--repo-id", "me/my-dex"]) == 0
    assert json.loads((tmp_path / "my-dex-hub" / "config.json").read_text())["auto_map"]
    assert (tmp_path / "my-dex-hub" / "tokenizer.json").is_file()
