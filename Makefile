# make test  — create .venv (torch CPU wheel first), install the project, run the test suite
# make demo  — run the demo ablation grid (experiments/demo.yaml) and write results/demo/
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install test demo bench clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: install
	$(BIN)/relpos-ablate train --config experiments/tiny_run.yaml --run-dir results/tiny_run

bench: install
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) .pytest_cache
