"""Every notebook in notebooks/ runs top to bottom (nbclient, a fresh kernel each), and is stored without outputs."""

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# Together the notebooks must stay under 3 minutes on 2 CPU cores (measured: about 20 + 45 + 55 s, plus about
# 45 s once per machine to convert SmolLM2's GGUF file); a cell that runs longer than this is a hang.
CELL_TIMEOUT_S = 150


def test_there_are_notebooks():
    assert {path.name for path in NOTEBOOKS} >= {"quickstart.ipynb", "dex_retrofit.ipynb", "attention_noise.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip the outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs(path, request, monkeypatch):
    # The kernel inherits this environment: no Hub, a non-interactive matplotlib, one intra-op thread (the suite
    # runs two workers on two cores), and the SmolLM2 safetensors copy kept in pytest's cache between runs.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MODELING_DIFF_CACHE", str(request.config.cache.mkdir("modeling_diff")))
    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.perf_counter() - started
    errors = [output for cell in notebook.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert not errors
    print(f"{path.name}: {elapsed:.1f} s")
