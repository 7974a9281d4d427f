"""transformers' own model tester mixins, for tests/test_transformers_mixins.py.

One package over two folders: first the top-level tests/*.py of the installed transformers release's sdist
(see `sdist.py`; `make transformers-tests` downloads them), then this folder, which supplies the modules those files
import that transformers publishes only in its git repository, never on PyPI (so a CI that reaches PyPI only
cannot have them):
- `distributed_testing_utils.py`: the process launcher of the FSDP and tensor-parallel mixins, written here;
- `generation/test_utils.py`, `exporters/test_export.py`: empty stand-ins for `GenerationTesterMixin` and
  `ExportTesterMixin`, so that `test_modeling_common.py` imports (their tests do not run here).
"""

from .sdist import tests_dir


__path__ = [str(tests_dir()), *__path__]
