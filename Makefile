# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

# torch==2.13.0 first: a bare `torch` requirement would pull a multi-GB CUDA build.
# Ray is pinned to the version everything here was tested with.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 'ray[default,train]==2.60.0'
	$(BIN)/pip install -q -e '.[test,plot,bench]'
	touch $@

demo: setup
	$(BIN)/elastic demo $(ARGS)

# Two pytest processes, each taking whole modules, the longest first (tests/conftest.py): one
# process leaves a core idle while runs wait on workers that start, heal or sleep through a step.
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(ARGS)

bench: setup
	$(BIN)/python -m benchmarks.bench $(ARGS)

clean:
	rm -rf $(VENV) runs
