# Two commands for a fresh machine: `make demo` and `make test` (both set everything up first).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines take the CPU wheel of torch first, so the range in pyproject.toml pulls no CUDA.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The oldest torch the engine supports: its core tests (-m torch_range) run again with it, from
# a folder that overlays the venv (.ci/torch_overlay.py).
TORCH_OLDEST ?= 2.11.0
TORCH_OLDEST_DIR ?= .torch-$(TORCH_OLDEST)

.PHONY: setup assets demo test test-torch-oldest lint format clean

setup: $(VENV)/.installed assets

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "GPU found: torch from pyproject's range"; \
	else \
	  $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	fi
	$(PY) -m pip install -q -e ".[dev,eval]"
	touch $@

# The bundled offline corpus and tokenizer (idempotent; cached under ~/.cache/titan/assets).
assets: $(VENV)/.installed
	$(PY) -m titan_core.data.assets

demo: setup
	$(VENV)/bin/titan demo

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)
	$(MAKE) test-torch-oldest

test-torch-oldest: setup
	$(PY) .ci/torch_overlay.py $(TORCH_OLDEST) $(TORCH_OLDEST_DIR)
	PYTHONPATH=$(TORCH_OLDEST_DIR) $(PY) -c "import torch; v = torch.__version__; \
	  assert v.split('+')[0] == '$(TORCH_OLDEST)', v; print('engine core tests on torch', v)"
	PYTHONPATH=$(TORCH_OLDEST_DIR) $(PY) -m pytest -q -m torch_range -p no:cacheprovider

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format:
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf outputs .pytest_cache .ruff_cache .torch-*
