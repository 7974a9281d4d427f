"""Where transformers' own test mixins live here: the top-level `tests/*.py` of the sdist of the installed
transformers release (`test_modeling_common.py`, `test_training_mixin.py`, `test_fsdp_mixin.py`,
`test_tensor_parallel_mixin.py`, ...), downloaded once from PyPI into the virtualenv so that reruns are offline.

`python tests/transformers_testers/sdist.py` (what `make transformers-tests` runs) fetches them;
`tests_dir()` is where they are.
"""

import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers


def tests_dir() -> Path:
    """The sdist's tests/ folder for the installed release, inside the running virtualenv."""
    return Path(sys.prefix) / "transformers-tests" / transformers.__version__ / "tests"


def fetch() -> Path:
    """Download the sdist of the installed release and keep its top-level tests/*.py; nothing is written half-way
    (extracted in a temporary folder, then renamed into place)."""
    target = tests_dir()
    if target.is_dir():
        print(f"transformers {transformers.__version__} tests: cached in {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"transformers=={transformers.__version__}", "--dest", tmp],
            check=True,
        )
        (archive,) = Path(tmp).glob("transformers-*.tar.gz")
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and re.fullmatch(r"[^/]+/tests/[^/]+\.py", m.name)]
            if not members:
                raise RuntimeError(f"{archive.name} holds no tests/*.py")
            tar.extractall(tmp, members=members, filter="data")
        (extracted,) = Path(tmp).glob("transformers-*/tests")
        extracted.rename(target)
    print(f"transformers {transformers.__version__} tests: {len(members)} files in {target}")
    return target


if __name__ == "__main__":
    fetch()
