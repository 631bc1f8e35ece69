# The two commands of the README. Each creates .venv and installs the package on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1 || \
		$(PY) -m pip install --quiet torch torchvision
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m lightning_mmpar.recipes.clip_llama fit --config recipes/clip_llama_cpu.yaml

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_mmpar tests benchmarks
	$(VENV)/bin/ruff format --check lightning_mmpar tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: $(STAMP) lint
	$(PY) -m pytest -q --durations=15 tests
