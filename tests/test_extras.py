"""Optional dependencies: the wheel declares the extras, and where one is missing the error names the extra that
installs it."""

import subprocess
import sys
import zipfile
from importlib.resources import files
from pathlib import Path

import pytest

from modeling_diff.conversion import convert_checkpoint
from modeling_diff.needle import NeedleResult, plot_needle_heatmap


def hide(monkeypatch, *modules):
    """Make `import module` fail as for a package that is not installed."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_plot_needle_heatmap_names_the_needle_extra(monkeypatch):
    hide(monkeypatch, "matplotlib", "matplotlib.pyplot")
    result = NeedleResult([64], [0.0], 1, 1, 1, [[1.0]], [[0.0]])
    with pytest.raises(ModuleNotFoundError, match=r"plot_needle_heatmap needs the 'matplotlib' package: "
                                                  r"pip install 'modeling-diff\[needle\]'"):
        plot_needle_heatmap(result)


def test_a_gguf_source_names_the_gguf_extra(monkeypatch, tmp_path):
    hide(monkeypatch, "gguf")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'modeling-diff\[gguf\]'"):
        convert_checkpoint(tmp_path / "model.gguf", tmp_path / "out", heads="all", progress=False)
    assert not (tmp_path / "out").exists()


def test_load_smollm2_names_the_gguf_extra(monkeypatch, tmp_path):
    from modeling_diff.data import load_smollm2

    hide(monkeypatch, "gguf")
    with pytest.raises(ModuleNotFoundError, match=r"load_smollm2 .* pip install 'modeling-diff\[gguf\]'"):
        load_smollm2(cache_dir=tmp_path)


def test_modeling_diff_eval_names_the_eval_extra(monkeypatch):
    from modeling_diff.lm_eval import main

    hide(monkeypatch, "lm_eval", "lm_eval.__main__")
    with pytest.raises(ModuleNotFoundError, match=r"modeling-diff eval needs the 'lm_eval' package: "
                                                  r"pip install 'modeling-diff\[eval\]'"):
        main(["--help"])


def test_modeling_diff_lora_names_the_peft_extra(monkeypatch):
    import importlib

    hide(monkeypatch, "peft")
    monkeypatch.delitem(sys.modules, "modeling_diff.lora")
    with pytest.raises(ModuleNotFoundError, match=r"modeling_diff.lora \(LoRA adapters\) needs the 'peft' package: "
                                                  r"pip install 'modeling-diff\[peft\]'"):
        importlib.import_module("modeling_diff.lora")


def test_a_missing_module_inside_an_installed_package_keeps_its_own_error():
    from modeling_diff.extras import require

    with pytest.raises(ModuleNotFoundError, match="matplotlib.no_such_module") as error:
        require("matplotlib.no_such_module", "a plot")
    assert "modeling-diff[" not in str(error.value)


def test_the_wheel_declares_the_extras_and_ships_the_calibration_text(tmp_path):
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(root),
                    "-w", str(tmp_path)], check=True)
    (wheel,) = tmp_path.glob("modeling_diff-*.whl")
    archive = zipfile.ZipFile(wheel)
    metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for requirement, extra in [("peft", "peft"), ("matplotlib", "needle"), ("gguf", "gguf"), ("lm-eval[hf]", "eval")]:
        assert f'Requires-Dist: {requirement}; extra == "{extra}"' in metadata
    shipped = (files("modeling_diff.conversion") / "calibration.txt").read_text(encoding="utf-8")
    assert archive.read("modeling_diff/conversion/calibration.txt").decode() == shipped


@pytest.mark.parametrize("peft", ["missing", "broken"])
def test_the_package_imports_without_a_working_peft(tmp_path, peft):
    """`import modeling_diff` registers PEFT's default targets for "diff_llama" where PEFT imports; a PEFT that does
    not (absent, or a release that fails with this transformers) must not break the package for users of the rest."""
    fake = tmp_path / "peft"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('this peft does not import')\n" if peft == "broken" else
                                      "raise ModuleNotFoundError(\"No module named 'peft'\", name='peft')\n")
    code = ("import modeling_diff; from modeling_diff import DiffLlamaForCausalLM, preset_config; "
            "DiffLlamaForCausalLM(preset_config('tiny-v2')); print('imported')")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr[-2000:]
