# The commands of the README. Each creates .venv and installs the package on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint

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

# The full CI set (.ci/run): lint, then every tier: tests/unit (one process, seconds),
# tests/distributed (gloo worlds of 2-8 processes), tests/recipes (the recipe end to end),
# tests/benchmarks (each benchmark's --smoke run).
test: $(STAMP) lint
	$(PY) -m pytest -q --durations=15 tests

# The unit tier alone: no process group of several processes, about a minute.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit
