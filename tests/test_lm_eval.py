"""lm-evaluation-harness through its real command line, on a local task (a task yaml and a jsonl file, no Hub):
a DEX conversion at t = 0 scores exactly as its source Llama, run by `modeling-diff eval`; the folder of
`modeling-diff export` scores the same in a plain `lm_eval` that loads its code with trust_remote_code."""

import json
import subprocess
from pathlib import Path

import pytest
from ecosystem_helpers import PYTHON, offline_env, save_byte_llama
from transformers import AutoModelForCausalLM

from modeling_diff.conversion import convert_checkpoint
from modeling_diff.conversion.cli import main as cli_main

TASK = "diff_tiny_mc"
ROLLING = "diff_tiny_rolling"
LINES = [
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune,",
    "Or to take arms against a sea of troubles",
    "And by opposing end them. To die: to sleep;",
    "No more; and by a sleep to say we end",
]


def _write_task(folder: Path) -> Path:
    """A multiple-choice task and a rolling-loglikelihood (perplexity) task over one local jsonl file."""
    folder.mkdir()
    docs = [{"question": line.rsplit(" ", 1)[0], "choices": [line.rsplit(" ", 1)[1], "sea", "tree", "sleep"],
             "answer": 0, "text": line} for line in LINES]
    (folder / "data.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "data.jsonl"}
test_split: test
"""
    (folder / "mc.yaml").write_text(f"""task: {TASK}
{common}output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (folder / "rolling.yaml").write_text(f"""task: {ROLLING}
{common}output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""")
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A random tiny Llama with a byte tokenizer, its DEX conversion (heads by entropy on the packaged text) and
    the export of that conversion."""
    root = tmp_path_factory.mktemp("lm_eval")
    save_byte_llama(root / "llama")
    convert_checkpoint(root / "llama", root / "dex", progress=False)
    return root


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return _write_task(tmp_path_factory.mktemp("lm_eval_tasks") / "tasks")


@pytest.fixture(scope="module")
def reference(checkpoints, tasks, tmp_path_factory):
    """The source Llama's scores, from a plain lm_eval."""
    result = _lm_eval([PYTHON, "-m", "lm_eval"], checkpoints / "llama", tmp_path_factory.mktemp("llama_run"), tasks)
    assert len(result["samples"][TASK]) == len(LINES) and len(result["samples"][ROLLING]) == len(LINES)
    return result


def _lm_eval(command: list[str], pretrained: Path, tmp_path: Path, tasks: Path, extra_model_args: str = "") -> dict:
    """Run an lm_eval command line on `pretrained`; the per-document results of both tasks."""
    out = tmp_path / "out"
    subprocess.run(
        [*command, "--model", "hf", "--model_args", f"pretrained={pretrained},dtype=float32{extra_model_args}",
         "--tasks", f"{TASK},{ROLLING}", "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2",
         "--output_path", str(out), "--log_samples"],
        check=True, env=offline_env(tmp_path, HF_DATASETS_OFFLINE="1"), cwd=tmp_path,
    )
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    samples = {}
    for task in (TASK, ROLLING):
        (samples_file,) = out.rglob(f"samples_{task}_*.jsonl")
        docs = [json.loads(line) for line in samples_file.read_text().splitlines()]
        samples[task] = {doc["doc_id"]: [float(resp[0]) for resp in doc["filtered_resps"]] if task == TASK
                         else float(doc["filtered_resps"][0]) for doc in docs}
    return {"results": results, "samples": samples}


def _assert_same_scores(result: dict, reference: dict) -> None:
    assert result["results"][TASK]["acc,none"] == reference["results"][TASK]["acc,none"]
    for doc_id, logliks in reference["samples"][TASK].items():  # log-likelihood of every choice of every doc
        assert result["samples"][TASK][doc_id] == pytest.approx(logliks, abs=1e-4)
    for doc_id, loglik in reference["samples"][ROLLING].items():
        assert result["samples"][ROLLING][doc_id] == pytest.approx(loglik, abs=1e-4)
    assert result["results"][ROLLING]["word_perplexity,none"] == pytest.approx(
        reference["results"][ROLLING]["word_perplexity,none"], rel=1e-5)


def test_dex_conversion_scores_as_its_source_through_modeling_diff_eval(checkpoints, tasks, reference, tmp_path):
    config = json.loads((checkpoints / "dex" / "config.json").read_text())
    converted = AutoModelForCausalLM.from_pretrained(checkpoints / "dex")
    converted.save_pretrained(tmp_path / "resaved")
    resaved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert config["diff_mode"] == "dex" and config["architectures"] == resaved["architectures"]  # as save_pretrained
    modeling_diff_cli = str(Path(PYTHON).with_name("modeling-diff"))  # the console script of `pip install`
    dex = _lm_eval([modeling_diff_cli, "eval"], checkpoints / "dex", tmp_path, tasks)
    _assert_same_scores(dex, reference)


def test_exported_folder_scores_as_its_source_in_a_plain_lm_eval(checkpoints, tasks, reference, tmp_path):
    export = tmp_path / "export"
    subprocess.run([PYTHON, "-m", "modeling_diff.conversion.cli", "export", str(checkpoints / "dex"), str(export)],
                   check=True, env=offline_env(tmp_path))
    assert (export / "modeling_diff_llama.py").is_file() and (export / "tokenizer.json").is_file()
    exported = _lm_eval([PYTHON, "-m", "lm_eval"], export, tmp_path, tasks, ",trust_remote_code=True")
    _assert_same_scores(exported, reference)


def test_modeling_diff_lm_eval_hands_its_arguments_to_lm_evals_cli(capsys):
    from modeling_diff.lm_eval import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0 and "usage: lm-eval" in capsys.readouterr().out


def test_export_refuses_a_checkpoint_that_is_not_a_diff_llama(checkpoints, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", str(checkpoints / "llama"), str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "src must be a 'diff_llama' checkpoint" in error and "'llama'" in error
    assert not (tmp_path / "out").exists()
