# Two entry points (README): `make run` trains the default LOOP run; `make test` runs the test suite.
# Both create or reuse .venv, install torch 2.13.0 (CPU build) first, then the project.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HASH := $(shell sha256sum pyproject.toml | cut -c1-12)
CONFIG ?= configs/loop_household_easy.yaml

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_HOME ?= $(CURDIR)/.prefect
export TOKENIZERS_PARALLELISM := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

.PHONY: setup setup-test run test clean-venv

$(VENV)/.base-$(HASH): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

# The tests also exercise the optional environments (TextWorld builds jericho from source: minutes, once).
$(VENV)/.test-$(HASH): $(VENV)/.base-$(HASH)
	$(BIN)/pip install -q -e ".[dev,textworld,scienceworld]"
	touch $@

setup: $(VENV)/.base-$(HASH)
setup-test: $(VENV)/.test-$(HASH)

run: setup
	$(BIN)/horizonrl train --config $(CONFIG) $(ARGS)

test: setup-test
	$(BIN)/python -m pytest -q $(ARGS)


clean-venv:
	rm -rf $(VENV)
