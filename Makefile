# The two commands of the README. Each creates .venv and installs what it needs on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test lint test-dist test-slow bench clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU wheel (2.13.0); install it first so nothing pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,math,serve]'
	# build the engine's fused CPU kernels now (~30 s, cached); without a compiler the engine uses eager ops
	-$(BIN)/python -c "from posttrain.ops import cpu_kernels; print('fused CPU kernels:', 'built' if cpu_kernels.load() else 'unavailable (eager ops)')"
	touch $(STAMP)

quickstart: $(STAMP)
	$(BIN)/posttrain models fetch smollm2-135m-instruct
	$(BIN)/posttrain quickstart

test: $(STAMP)
	$(BIN)/python -m pytest

# ruff with pyproject's rules: pyflakes, pycodestyle, bugbear, import order, unused noqa, complexity
lint: $(STAMP)
	$(BIN)/ruff check posttrain tests benchmarks scripts

# distributed tests: FSDP2 with 2 gloo processes, a local Ray cluster (installs the [ray] extra)
test-dist: $(STAMP)
	$(BIN)/pip install -q -e '.[ray]'
	$(BIN)/python -m pytest -m dist

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/sft_vs_trl.py

clean-venv:
	rm -rf $(VENV)
