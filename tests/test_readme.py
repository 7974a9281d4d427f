"""The README's quick start runs as written (in a temporary working directory)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section(name: str) -> str:
    text = README.read_text()
    return text[text.index(f"<!-- section:{name} -->") : text.index(f"<!-- /section:{name} -->")]


def test_quick_start_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", section("foundation"), flags=re.S)
    assert blocks, "the foundation section has a python quick start"
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
