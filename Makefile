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

# demo: train the grid (done runs are skipped, so a rerun only redraws), then write the report files
# results/demo/{summary.csv,table.md,table.tex,figures/}. Only those are committed (.gitignore): the run
# dirs with their checkpoints stay local, so on a fresh clone `make demo` retrains (~3 min, 2 cores).
DEMO := results/demo
DEMO_FIRST_RUN = $(BIN)/python -c "from relpos_ablate.runner.grid import load_grid; \
	print(load_grid('experiments/demo.yaml').runs[0].run_id)"

demo: install
	$(BIN)/relpos-ablate grid experiments/demo.yaml --slots 2 --results results
	$(BIN)/relpos-ablate collect $(DEMO) --out $(DEMO)/summary.csv
	$(BIN)/relpos-ablate table $(DEMO) --out $(DEMO)/table.md
	$(BIN)/relpos-ablate table $(DEMO) --out $(DEMO)/table.tex
	$(BIN)/relpos-ablate plot $(DEMO) --kind extrapolation --out $(DEMO)/figures
	$(BIN)/relpos-ablate plot $(DEMO) --kind bias --out $(DEMO)/figures
	run=$$($(DEMO_FIRST_RUN)) && for kind in terms attention; do \
		$(BIN)/relpos-ablate plot $(DEMO)/$$run --kind $$kind --out $(DEMO)/figures || exit 1; done

bench: install
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) .pytest_cache
