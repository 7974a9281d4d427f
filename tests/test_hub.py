"""Hub export with remote code: a flat self-contained folder that loads with trust_remote_code=True in a Python
where `modeling_diff` is not importable, and generates the same tokens; push_to_hub uploads exactly that folder."""

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ecosystem_helpers import PYTHON, REPO, byte_tokenizer, offline_env, readme_snippet, tiny_config
from huggingface_hub import HfApi
from transformers import (AutoModelForCausalLM, AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification, AutoTokenizer)
from transformers.dynamic_module_utils import get_imports, get_relative_import_files

import modeling_diff
from modeling_diff import (DiffLlamaConfig, DiffLlamaForCausalLM, DiffLlamaForQuestionAnswering,
                           DiffLlamaForSequenceClassification, DiffLlamaForTokenClassification, set_anneal_step)
from modeling_diff.hub import flatten_modules, model_card, push_to_hub, save_for_hub

# Packages a remote-code user must have: the standard library, torch and transformers (with its huggingface_hub).
HARD_REQUIREMENTS = set(sys.stdlib_module_names) | {"torch", "transformers", "huggingface_hub"}
PROMPT = [[5, 17, 99, 3, 42, 7], [8, 8, 200, 31, 64, 2]]

# Runs in a fresh `python -I` (no PYTHONPATH, no cwd on sys.path) that also drops the editable-install finder and
# every repository path but the virtual environment's, so `modeling_diff` cannot be imported: only the exported files can serve.
WITHOUT_THE_PACKAGE = r"""
import json, sys, importlib.util
REPO = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
def in_repo(path):  # the repository's own folders; virtual environments' (make test-floor's two) may live inside it
    return (path + "/").startswith(REPO + "/") and "site-packages" not in path.split("/")
sys.path[:] = [p for p in sys.path if "__editable__" not in p and not in_repo(p)]
sys.path_importer_cache.clear()
result = {"modeling_diff_importable": importlib.util.find_spec("modeling_diff") is not None}
"""
FRESH_PROCESS = WITHOUT_THE_PACKAGE + r"""
import torch
from transformers import (AutoModelForCausalLM, AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification)
prompt = torch.tensor(json.loads(sys.argv[2]))
for folder in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokens = model.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt))
    result[folder] = {"tokens": tokens.tolist(), "class": type(model).__module__ + "." + type(model).__name__}
    for auto in (AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoModelForQuestionAnswering):
        head = auto.from_pretrained(folder, trust_remote_code=True).eval()
        with torch.no_grad():
            hidden = head.model(prompt).last_hidden_state
        result[folder][auto.__name__] = {"class": type(head).__name__, "base": type(head.model).__module__ + "." +
                                         type(head.model).__name__, "hidden": hidden.tolist()}
result["modeling_diff_loaded"] = any(name.startswith("modeling_diff") for name in sys.modules)
print("RESULT" + json.dumps(result))
"""


def imported_packages(path: Path) -> set:
    """Top-level packages of a file's absolute imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names


def trained_looking_model(mode: str) -> DiffLlamaForCausalLM:
    """A tiny model whose differential terms are all active (DEX: f_D non-zero and lambda annealed in)."""
    torch.manual_seed(0)
    model = DiffLlamaForCausalLM(tiny_config(mode, anneal_steps=10 if mode != "v1" else 0)).eval()
    if mode == "dex":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.dex_proj.weight.normal_(0, 0.3)
        set_anneal_step(model, 5)
    return model


def greedy(model, prompt) -> list:
    prompt = torch.tensor(prompt)
    return model.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt)).tolist()


def test_remote_code_export_loads_without_the_package(tmp_path):
    """Every head loads from the folder through its Auto class on the model of the folder's code: the heads built
    transformers' own DiffLlama (another model, which failed to load the weights) before AutoModel was registered
    wherever the model's module is imported."""
    expected, hidden, folders = {}, {}, []
    for mode in ("v1", "v2", "dex"):
        model = trained_looking_model(mode)
        folder = save_for_hub(model, tmp_path / f"export-{mode}")
        expected[str(folder)] = greedy(model, PROMPT)
        with torch.no_grad():
            hidden[str(folder)] = model.model(torch.tensor(PROMPT)).last_hidden_state
        folders.append(str(folder))

        # Flat: no sub-folders; every file transformers' loader follows from auto_map exists and imports only
        # installed packages; nothing names modeling_diff.
        files = {p.name for p in folder.iterdir()}
        assert all(p.is_file() for p in folder.iterdir())
        assert {"config.json", "model.safetensors", "README.md", "modeling_diff_llama.py", "diff_attention.py",
                "configuration_diff_llama.py"} <= files
        auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
        assert auto_map["AutoConfig"] == "configuration_diff_llama.DiffLlamaConfig"
        assert auto_map["AutoModelForCausalLM"] == "remote_code.DiffLlamaForCausalLM"
        for reference in auto_map.values():
            module_file = folder / (reference.rpartition(".")[0] + ".py")
            for needed in [str(module_file), *get_relative_import_files(module_file)]:
                assert Path(needed).exists(), needed
                # What the loader's check_imports demands on the user's machine: only the model's hard
                # requirements (optional ones, triton, must sit in try blocks), and never modeling_diff.
                assert set(get_imports(needed)) <= HARD_REQUIREMENTS, (needed, get_imports(needed))
                assert not imported_packages(Path(needed)) & {"modeling_diff"}

    out = subprocess.run(
        [PYTHON, "-I", "-c", FRESH_PROCESS, str(REPO), json.dumps(PROMPT), *folders],
        cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT", 1)[1])
    assert result.pop("modeling_diff_importable") is False
    assert result.pop("modeling_diff_loaded") is False
    for folder in folders:
        assert result[folder]["class"].startswith("transformers_modules."), result[folder]["class"]
        assert result[folder]["class"].endswith(".modeling_diff_llama.DiffLlamaForCausalLM")
        assert result[folder]["tokens"] == expected[folder]
        for auto, head in (("AutoModelForSequenceClassification", "DiffLlamaForSequenceClassification"),
                           ("AutoModelForTokenClassification", "DiffLlamaForTokenClassification"),
                           ("AutoModelForQuestionAnswering", "DiffLlamaForQuestionAnswering")):
            assert result[folder][auto]["class"] == head
            assert result[folder][auto]["base"].startswith("transformers_modules."), result[folder][auto]["base"]
            assert result[folder][auto]["base"].endswith(".modeling_diff_llama.DiffLlamaModel")
            torch.testing.assert_close(torch.tensor(result[folder][auto]["hidden"]), hidden[folder])


# A fresh process (WITHOUT_THE_PACKAGE) that imports PEFT first, then builds the exported folder's model: PEFT's
# configs without target_modules, as on a Llama built in the same process.
PEFT_PROCESS = WITHOUT_THE_PACKAGE + r"""
from peft import IA3Config, LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
llama = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
for name, make in (("lora", lambda: LoraConfig(task_type="CAUSAL_LM")),
                   ("ia3", lambda: IA3Config(task_type="CAUSAL_LM"))):
    expected = sorted(get_peft_model(LlamaForCausalLM(llama), make()).peft_config["default"].target_modules)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True), make())
    result[name] = {"expected": expected, "got": sorted(model.peft_config["default"].target_modules),
                    "class": type(model.get_base_model()).__module__}
result["modeling_diff_loaded"] = any(name.startswith("modeling_diff") for name in sys.modules)
print("RESULT" + json.dumps(result))
"""


def test_peft_configs_without_target_modules_adapt_an_exported_folders_model_as_a_llama(tmp_path):
    """An exported folder's model (remote code, no modeling_diff) had no PEFT default targets: `import
    modeling_diff` registers them (modeling_diff.lora), which the remote code never runs, so `LoraConfig(
    task_type="CAUSAL_LM")` raised "Please specify `target_modules`". A model built after PEFT is imported has them."""
    folder = save_for_hub(trained_looking_model("v2"), tmp_path / "export")
    assert (folder / "peft_targets.py").is_file()
    out = subprocess.run([PYTHON, "-I", "-c", PEFT_PROCESS, str(REPO), str(folder)], cwd=tmp_path,
                         env=offline_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT", 1)[1])
    assert result.pop("modeling_diff_importable") is False and result.pop("modeling_diff_loaded") is False
    for method in ("lora", "ia3"):
        assert result[method]["class"].startswith("transformers_modules."), result[method]
        assert result[method]["got"] == result[method]["expected"] != [], result[method]


# A fresh process (WITHOUT_THE_PACKAGE) that builds the exported folder's model first and then imports PEFT (the next
# cell of a notebook).
PEFT_LATER_PROCESS = WITHOUT_THE_PACKAGE + r"""
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True)
result["imported_by_loading"] = "peft" in sys.modules
from peft import LoraConfig, get_peft_model
config = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM")).peft_config["default"]
result["targets"] = sorted(config.target_modules)
result["class"] = type(model).__module__
result["modeling_diff_loaded"] = any(name.startswith("modeling_diff") for name in sys.modules)
print("RESULT" + json.dumps(result))
"""


# A fresh process (WITHOUT_THE_PACKAGE) that loads the exported folder's model and then trains it with Trainer's
# use_liger_kernel=True, which imports Liger.
LIGER_LATER_PROCESS = WITHOUT_THE_PACKAGE + r"""
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True)
result["imported_by_loading"] = "liger_kernel" in sys.modules
args = TrainingArguments(output_dir=sys.argv[3], use_cpu=True, report_to=[], use_liger_kernel=True, max_steps=1,
                         per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True)
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 60, (2, 8))]
Trainer(model=model, args=args, train_dataset=data).train()
result["loss_module"] = getattr(model.fused_linear_loss, "__module__", None)
result["class"] = type(model).__module__
result["modeling_diff_loaded"] = any(name.startswith("modeling_diff") for name in sys.modules)
print("RESULT" + json.dumps(result))
"""


def test_liger_imported_after_an_exported_folders_model_is_loaded_patches_it(tmp_path):
    """Without modeling_diff, Trainer's use_liger_kernel=True patched nothing on the folder's model: "diff_llama" was
    in Liger's dispatch only after `import modeling_diff`. Now the folder's code registers when Liger is imported,
    and the model gets the folder's own fused loss. Loading the model still does not import Liger."""
    folder = save_for_hub(trained_looking_model("v2"), tmp_path / "export")
    assert (folder / "liger.py").is_file() and (folder / "remote_code.py").is_file()
    out = subprocess.run([PYTHON, "-I", "-c", LIGER_LATER_PROCESS, str(REPO), str(folder), str(tmp_path / "out")],
                         cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT", 1)[1])
    assert result["modeling_diff_importable"] is False and result["modeling_diff_loaded"] is False
    assert result["imported_by_loading"] is False and result["class"].startswith("transformers_modules."), result
    assert result["loss_module"] == result["class"].rpartition(".")[0] + ".liger", result


def test_peft_imported_after_an_exported_folders_model_is_built_has_its_default_targets(tmp_path):
    """Without modeling_diff, the folder's model registered PEFT's default targets only where PEFT was imported
    before the model was built: `LoraConfig(task_type="CAUSAL_LM")` in a later cell raised "Please specify
    `target_modules`". Loading the model still does not import PEFT."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as LORA_TARGETS

    folder = save_for_hub(trained_looking_model("v2"), tmp_path / "export")
    out = subprocess.run([PYTHON, "-I", "-c", PEFT_LATER_PROCESS, str(REPO), str(folder)], cwd=tmp_path,
                         env=offline_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT", 1)[1])
    assert result["modeling_diff_importable"] is False and result["modeling_diff_loaded"] is False
    assert result["imported_by_loading"] is False and result["class"].startswith("transformers_modules."), result
    assert result["targets"] == sorted(LORA_TARGETS["llama"]), result


# A fresh process (WITHOUT_THE_PACKAGE) that saves an exported folder's models again with their own save_pretrained:
# the causal LM, a task head, the causal LM in shards of 20 KB with transformers' positional arguments, and with
# push_to_hub=True (the Hub's commit recorded, nothing sent).
RESAVE_PROCESS = WITHOUT_THE_PACKAGE + r"""
from pathlib import Path
from huggingface_hub import HfApi
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
source, out = sys.argv[2], Path(sys.argv[3])
AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).save_pretrained(out / "causal")
AutoModelForSequenceClassification.from_pretrained(source, trust_remote_code=True).save_pretrained(out / "head")
AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).save_pretrained(out / "shards", True, None,
                                                                                     False, "20KB")
result["commits"] = []
HfApi.create_repo = lambda self, repo_id, **kwargs: type("Url", (), {"repo_id": repo_id})()
HfApi.create_commit = lambda self, repo_id, operations, **kwargs: result["commits"].append(
    {"repo_id": repo_id, "commit_message": kwargs.get("commit_message"),
     "files": {op.path_in_repo: Path(op.path_or_fileobj).read_bytes().hex() for op in operations}})
AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True).save_pretrained(
    out / "pushed", push_to_hub=True, repo_id="me/diff", commit_message="again", max_shard_size="20KB")
result["modeling_diff_loaded"] = any(name.startswith("modeling_diff") for name in sys.modules)
print("RESULT" + json.dumps(result))
"""


def test_an_exported_folders_model_saved_again_with_save_pretrained_keeps_the_folders_code(tmp_path):
    """transformers' save_pretrained of a remote-code model copies the model class's file and its imports and names
    that file in auto_map for the class's Auto class: the folder lost remote_code.py, so AutoModel and the task heads
    (whose entries name it) did not load from it, and PEFT's default targets were not registered. The re-saved folder
    now holds the exported folder's code, byte for byte, and its auto_map; its model generates the exported model's
    tokens, its heads load, and PEFT adapts it as a Llama (in fresh processes without the package). transformers'
    positional arguments are taken (they raised a TypeError), and push_to_hub=True uploads the folder as written (it
    saved the model again, in one file, leaving out the shards asked for)."""
    model = trained_looking_model("dex")
    folder = save_for_hub(model, tmp_path / "export")
    # A crafted entry of the folder's auto_map names a file outside the folder's code by its path: never copied.
    (tmp_path / "secret.py").write_text("TOKEN = 'not to be published'\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"]["AutoModelForMaskedLM"] = f"{tmp_path}/secret.DiffLlamaModel"
    (folder / "config.json").write_text(json.dumps(config))
    out = subprocess.run([PYTHON, "-I", "-c", RESAVE_PROCESS, str(REPO), str(folder), str(tmp_path)], cwd=tmp_path,
                         env=offline_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT", 1)[1])
    assert result["modeling_diff_importable"] is False and result["modeling_diff_loaded"] is False
    exported_code = {path.name: path.read_bytes() for path in folder.glob("*.py")}
    exported_auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    for saved in ("causal", "head", "shards", "pushed"):
        assert {path.name: path.read_bytes() for path in (tmp_path / saved).glob("*.py")} == exported_code, saved
        assert json.loads((tmp_path / saved / "config.json").read_text())["auto_map"] == exported_auto_map, saved
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    # push_to_hub=True uploads in one commit the folder it wrote, as it wrote it (its shards, the whole code)
    [commit] = result["commits"]
    assert commit["repo_id"] == "me/diff" and commit["commit_message"] == "again"
    written = {path.name: path.read_bytes().hex() for path in (tmp_path / "pushed").iterdir()}
    assert commit["files"] == written and "model.safetensors.index.json" in written

    resaved = str(tmp_path / "causal")
    loaded = subprocess.run([PYTHON, "-I", "-c", FRESH_PROCESS, str(REPO), json.dumps(PROMPT), resaved],
                            cwd=tmp_path, env=offline_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    loaded = json.loads(loaded.stdout.split("RESULT", 1)[1])
    assert loaded["modeling_diff_loaded"] is False
    assert loaded[resaved]["tokens"] == greedy(model, PROMPT)
    with torch.no_grad():
        hidden = model.model(torch.tensor(PROMPT)).last_hidden_state
    for auto in ("AutoModelForSequenceClassification", "AutoModelForTokenClassification",
                 "AutoModelForQuestionAnswering"):
        torch.testing.assert_close(torch.tensor(loaded[resaved][auto]["hidden"]), hidden)
    peft = subprocess.run([PYTHON, "-I", "-c", PEFT_PROCESS, str(REPO), resaved], cwd=tmp_path,
                          env=offline_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert peft.returncode == 0, peft.stderr[-3000:]
    peft = json.loads(peft.stdout.split("RESULT", 1)[1])
    assert peft["lora"]["got"] == peft["lora"]["expected"] != [], peft


def test_an_exported_folder_loaded_as_the_package_s_classes_saves_without_the_folder_s_auto_map(tmp_path):
    """After `import modeling_diff` an exported folder loads as the package's classes, whose save_pretrained writes no
    model code: config.json kept the folder's auto_map, which names files the new folder does not hold, and a Python
    without the package failed to load it (no configuration_diff_llama.py). The auto_map is left out now, with a
    warning naming save_for_hub; the folder loads with the package, and the loaded model keeps its auto_map."""
    from transformers.testing_utils import CaptureLogger

    import modeling_diff.modeling_diff_llama as modeling

    model = trained_looking_model("v2")
    folder = save_for_hub(model, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert type(loaded) is DiffLlamaForCausalLM
    with CaptureLogger(modeling.logger) as captured:
        loaded.save_pretrained(tmp_path / "saved")
    assert "save_for_hub" in captured.out
    assert "auto_map" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    assert loaded.config.auto_map == json.loads((folder / "config.json").read_text())["auto_map"]
    assert greedy(AutoModelForCausalLM.from_pretrained(tmp_path / "saved"), PROMPT) == greedy(model, PROMPT)


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_export_loads_with_the_package_classes_when_imported(tmp_path, trust_remote_code):
    """README (Liger Kernel): an exported remote-code folder loaded after `import modeling_diff`, with or without
    `trust_remote_code=True`, loads as the package's classes (`modeling_diff.DiffLlamaForCausalLM`, its config and
    heads), not the folder's copy of the code, and generates the exported model's tokens."""
    model = trained_looking_model("v2")
    folder = save_for_hub(model, tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust_remote_code).eval()
    assert type(loaded) is DiffLlamaForCausalLM and type(loaded.config) is DiffLlamaConfig
    assert greedy(loaded, PROMPT) == greedy(model, PROMPT)
    for auto, head in ((AutoModelForSequenceClassification, DiffLlamaForSequenceClassification),
                       (AutoModelForTokenClassification, DiffLlamaForTokenClassification),
                       (AutoModelForQuestionAnswering, DiffLlamaForQuestionAnswering)):
        assert type(auto.from_pretrained(folder, trust_remote_code=trust_remote_code)) is head


def test_save_for_hub_writes_whole_folders_only(tmp_path):
    model = trained_looking_model("v1")
    target = tmp_path / "export"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="save_directory .* not empty"):
        save_for_hub(model, target)

    class BrokenTokenizer:
        def save_pretrained(self, folder):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_for_hub(model, target, tokenizer=BrokenTokenizer(), overwrite="force")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no staging folder left behind
    assert [p.name for p in target.iterdir()] == ["keep.txt"]  # the old content is untouched

    with pytest.raises(ValueError, match="holds no config.json, so it is not an earlier output"):
        save_for_hub(model, target, overwrite=True)  # one overwrite replaces an earlier output only
    save_for_hub(model, target, overwrite="force")
    assert not (target / "keep.txt").exists() and (target / "modeling_diff_llama.py").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    save_for_hub(model, target, overwrite=True)  # an earlier output (a config.json)
    with pytest.raises(ValueError, match="must not be, contain or lie inside the source"):
        save_for_hub(model, target / "sub", protect=(target,))


def test_save_for_hub_off_the_main_process_writes_nothing_and_keeps_an_earlier_export(tmp_path):
    """Every rank of a DDP script saving, as with `save_pretrained`: on a rank with `is_main_process=False`
    transformers writes nothing, and save_for_hub then failed on the staging folder's missing config.json."""
    model = trained_looking_model("v2")
    assert save_for_hub(model, tmp_path / "rank1", is_main_process=False) == (tmp_path / "rank1").resolve()
    assert list(tmp_path.iterdir()) == []
    export = save_for_hub(model, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    save_for_hub(model, export, overwrite=True, is_main_process=False)
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before
    with pytest.raises(ValueError, match="repo_id"):  # the arguments are checked on every rank alike
        save_for_hub(model, tmp_path / "rank1", repo_id="a/b/c", is_main_process=False)


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_save_for_hub_refuses_a_folder_whose_path_is_not_utf8(tmp_path, with_tokenizer):
    """safetensors opens and tokenizers writes UTF-8 paths only: with a tokenizer the writer failed with a
    UnicodeEncodeError ("surrogates not allowed"), without one the folder was written but could not be loaded.
    Refused before anything is written, naming the argument and the rule."""
    bad = tmp_path / os.fsdecode(b"out-\xff")
    tokenizer = byte_tokenizer() if with_tokenizer else None
    with pytest.raises(ValueError, match=r"^save_directory b'.*out-\\xff' is not valid UTF-8: .* UTF-8 paths only"):
        save_for_hub(trained_looking_model("v2"), bad, tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("repo_id", ['a"b\n---\nlicense: evil', "org/name\n", "a/b/c", "", "-name", "a..b", "caf\u00e9",
                                     "x" * 97, 7])
def test_save_for_hub_and_model_card_refuse_a_repo_id_that_is_no_hub_repository_id(tmp_path, repo_id):
    """`repo_id` was pasted verbatim into the model card: a quote broke its `from_pretrained("...")` snippet and a
    newline injected YAML front matter (`license: evil`). Refused as the Hub refuses it, before anything is written,
    by `save_for_hub` and (README: "`repo_id` (of `save_for_hub`, `model_card`, ...)") by `model_card` itself, with
    a ValueError naming the field."""
    match = r"^repo_id must be a Hub repository id \('name' or 'namespace/name'"
    with pytest.raises(ValueError, match=match):
        save_for_hub(trained_looking_model("v2"), tmp_path / "export", repo_id=repo_id)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=match):
        model_card(trained_looking_model("v2"), repo_id)
    card = (save_for_hub(trained_looking_model("v2"), tmp_path / "ok", repo_id="me/tiny.diff-2_b") / "README.md")
    assert 'from_pretrained("me/tiny.diff-2_b", trust_remote_code=True)' in card.read_text()


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_push_to_hub_uploads_the_export_folder(tmp_path, with_tokenizer):
    """No network: a recording HfApi stands in; its calls must bind to the real HfApi signatures. README:
    `push_to_hub(model, "me/name", tokenizer=...)` uploads the tokenizer's files with the model, in the one commit,
    and they load as the tokenizer given."""

    class RecordingApi:
        calls = []

        def create_repo(self, *args, **kwargs):
            inspect.signature(HfApi.create_repo).bind(self, *args, **kwargs)
            self.calls.append(("create_repo", args, kwargs))
            return type("RepoUrl", (), {"repo_id": "me/tiny-diff"})()

        def upload_folder(self, **kwargs):
            inspect.signature(HfApi.upload_folder).bind(self, **kwargs)
            folder = Path(kwargs["folder_path"])
            self.calls.append(("upload_folder", {p.name: p.read_bytes() for p in folder.iterdir()}, kwargs))
            return "commit-info"

    model = trained_looking_model("dex")
    api = RecordingApi()
    tokenizer = byte_tokenizer() if with_tokenizer else None
    assert push_to_hub(model, "me/tiny-diff", tokenizer=tokenizer, api=api, private=True) == "commit-info"
    (_, args, kwargs), (_, uploaded, upload_kwargs) = api.calls
    assert args == ("me/tiny-diff",) and kwargs["private"] is True and kwargs["exist_ok"] is True
    assert upload_kwargs["repo_id"] == "me/tiny-diff" and upload_kwargs["repo_type"] == "model"

    reference = save_for_hub(model, tmp_path / "reference", tokenizer=tokenizer, repo_id="me/tiny-diff")
    assert uploaded == {p.name: p.read_bytes() for p in reference.iterdir()}
    assert ("tokenizer.json" in uploaded) == ("tokenizer_config.json" in uploaded) == with_tokenizer
    if with_tokenizer:  # the uploaded files, as a user downloads them, are the tokenizer given
        downloaded = tmp_path / "downloaded"
        downloaded.mkdir()
        for name, data in uploaded.items():
            (downloaded / name).write_bytes(data)
        text = "To be, or not to be: caf\u00e9"
        assert AutoTokenizer.from_pretrained(downloaded)(text).input_ids == tokenizer(text).input_ids
    card = uploaded["README.md"].decode()
    assert "custom_code" in card and 'from_pretrained("me/tiny-diff", trust_remote_code=True)' in card
    with pytest.raises(ValueError, match="repo_id"):
        push_to_hub(model, "a/b/c", api=api)


def test_push_to_hub_on_another_rank_uploads_nothing(monkeypatch):
    """Every rank of a distributed run may call it, as save_for_hub: a rank other than 0 writes no folder and makes
    no call to the Hub (each rank had uploaded a commit of its own)."""
    import torch.distributed

    class RefusingApi:
        def __getattr__(self, name):
            pytest.fail(f"another rank called the Hub ({name})")

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    assert push_to_hub(trained_looking_model("v1"), "me/tiny-diff", api=RefusingApi()) is None


def test_save_for_hub_refuses_push_to_hub_which_would_upload_its_staging_folder(tmp_path, monkeypatch):
    """`save_for_hub(model, folder, push_to_hub=True)` handed push_to_hub on to save_pretrained, which tried to upload
    the hidden staging folder (a repository named after it) before the model code, auto_map and card were in it."""
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("the Hub was called"))
    with pytest.raises(ValueError, match=r"push_to_hub=True is no save_for_hub argument: .*hub\.push_to_hub\(model"):
        save_for_hub(trained_looking_model("v2"), tmp_path / "export", push_to_hub=True)
    assert list(tmp_path.iterdir()) == []


def test_save_for_hub_refuses_a_distributed_checkpoint_which_each_rank_writes_itself(tmp_path):
    """`distributed_checkpoint=True` has every rank write its DCP shards into the folder, which save_for_hub stages
    on the main process alone: refused before anything is written."""
    with pytest.raises(ValueError, match=r"distributed_checkpoint=True is no save_for_hub argument: each rank"):
        save_for_hub(trained_looking_model("dex"), tmp_path / "export", distributed_checkpoint=True)
    assert list(tmp_path.iterdir()) == []


def write_package(root: Path, files: dict) -> None:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_flatten_follows_reexports_lazy_and_optional_imports(tmp_path, monkeypatch):
    """The import-graph walk on a nested package shaped like ours (a re-exporting sub-package, a lazily imported
    optional kernels sub-package): the flat files work as one package, and transformers' loader finds them all."""
    write_package(tmp_path / "src", {
        "pkgx/__init__.py": "from .model import Model\n",
        "pkgx/conf/__init__.py": "from .settings import Settings as Settings\n",
        "pkgx/conf/settings.py": "class Settings:\n    scale = 3\n",
        "pkgx/helpers.py": "def double(x):\n    return 2 * x\n",
        "pkgx/kernels/__init__.py": "",
        "pkgx/kernels/fast.py": "from ..helpers import double\n\ndef triple(x):\n    return double(x) + x\n",
        "pkgx/model.py": """\
            from .conf import Settings
            from pkgx.helpers import double as twice


            class Model:
                def run(self, x):
                    try:
                        from .kernels.fast import triple  # optional, lazy
                    except ImportError:
                        triple = None
                    from . import helpers
                    return twice(x) * Settings.scale, helpers.double(x), triple(x)
            """,
    })
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    sources = flatten_modules(["pkgx.model"])
    assert sorted(sources) == ["fast", "helpers", "model", "settings"]

    flat = tmp_path / "flat" / "flatpkg"
    write_package(flat, {"__init__.py": "", **{f"{name}.py": src for name, src in sources.items()}})
    assert {Path(f).name for f in get_relative_import_files(flat / "model.py")} == {"fast.py", "helpers.py",
                                                                                      "settings.py"}
    monkeypatch.syspath_prepend(str(tmp_path / "flat"))
    from flatpkg.model import Model

    assert Model().run(5) == (30, 10, 15)
    assert "pkgx" not in sys.modules["flatpkg.model"].__dict__

    bad = {"pkgy/__init__.py": "", "pkgy/a.py": "import pkgy.b\n", "pkgy/b.py": "",
           "pkgy/star.py": "from .b import *\n", "pkgy/sub/__init__.py": "", "pkgy/sub/b.py": "",
           "pkgy/clash.py": "from .b import x\nfrom .sub.b import y\n"}
    write_package(tmp_path / "src", bad)
    with pytest.raises(ValueError, match="cannot be exported as flat"):
        flatten_modules(["pkgy.a"])
    with pytest.raises(ValueError, match=r"import \*"):
        flatten_modules(["pkgy.star"])
    with pytest.raises(ValueError, match=r"would both be exported as b.py"):
        flatten_modules(["pkgy.clash"])


def test_readme_hub_snippet(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(readme_snippet("hub"), {})
    folder = tmp_path / "diffllama-tiny"
    assert json.loads((folder / "config.json").read_text())["auto_map"]["AutoConfig"].startswith("configuration_")
    assert (folder / "modeling_diff_llama.py").exists()
    assert modeling_diff.__name__ == "modeling_diff"


def test_a_model_of_an_exported_folders_remote_code_is_refused_saying_how_to_export_it(tmp_path):
    """A model loaded from an exported folder with trust_remote_code=True (before modeling_diff was imported) is of
    the folder's copy of the class: save_for_hub refused it as "must be of a class registered with an Auto class
    ['DiffLlamaConfig'], got DiffLlamaForCausalLM", naming a config class and the model's own class name. The error
    now says where the class comes from and how to export it."""
    remote = type(DiffLlamaForCausalLM.__name__, (DiffLlamaForCausalLM,),
                  {"__module__": "transformers_modules.export.modeling_diff_llama"})
    with pytest.raises(ValueError, match=r"model is a DiffLlamaForCausalLM of remote code \(transformers_modules\."
                                         r"export\.modeling_diff_llama\), loaded from an exported folder .*"
                                         r"modeling_diff\.DiffLlamaForCausalLM\.from_pretrained\(folder\)"):
        save_for_hub(remote(tiny_config("v1")), tmp_path / "out")
    assert not (tmp_path / "out").exists()
