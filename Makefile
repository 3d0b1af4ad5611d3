# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

# torch==2.13.0 first: a bare `torch` requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

demo: setup
	$(BIN)/elastic demo $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/python benchmarks/bench.py $(ARGS)

clean:
	rm -rf $(VENV) runs
