"""`pip install .` ships one top-level package, `modeling_diff`, with every source file of the three folders
mapped into it (`configuration/` -> `modeling_diff.configuration`, `conversion/` -> `modeling_diff.conversion`)."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"modeling_diff": "modeling_diff", "configuration": "modeling_diff/configuration", "conversion": "modeling_diff/conversion"}


def test_wheel_holds_only_modeling_diff_with_all_sources(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(tmp_path)],
        check=True,
    )
    (wheel,) = tmp_path.glob("modeling_diff-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"modeling_diff"}
    expected = {
        f"{installed}/{path.relative_to(ROOT / folder).as_posix()}"
        for folder, installed in FOLDERS.items()
        for path in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert expected - names == set(), "source files missing from the wheel (add their package to setup.cfg)"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "modeling-diff = modeling_diff.conversion.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
