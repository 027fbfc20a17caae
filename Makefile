# make test  — create .venv (torch CPU wheel first), install the project, run the test suite
# make demo  — run the demo ablation grid (experiments/demo.yaml) and write results/demo/
# make lengthgen — the length-generalization reproduction (~1 h on 2 CPU cores) and its report
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install test demo lengthgen bench clean

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

# $(call report,NAME): train experiments/NAME.yaml (done runs are skipped, so a rerun only redraws), then
# write results/NAME/{summary.csv,table.md,table.tex} (tables as the spec's table: block says)
define report
	$(BIN)/relpos-ablate grid experiments/$(1).yaml --slots 2 --results results
	$(BIN)/relpos-ablate collect results/$(1) --out results/$(1)/summary.csv
	$(BIN)/relpos-ablate table results/$(1) --out results/$(1)/table.md
	$(BIN)/relpos-ablate table results/$(1) --out results/$(1)/table.tex
endef

# demo: train the grid (done runs are skipped, so a rerun only redraws), then write the report files
# results/demo/{summary.csv,table.md,table.tex,figures/}. Only those are committed (.gitignore): the run
# dirs with their checkpoints stay local, so on a fresh clone `make demo` retrains (~3 min, 2 cores).
DEMO := results/demo
DEMO_FIRST_RUN = $(BIN)/python -c "from relpos_ablate.runner.grid import load_grid; \
	print(load_grid('experiments/demo.yaml').runs[0].run_id)"

demo: install
	$(call report,demo)
	$(BIN)/relpos-ablate plot $(DEMO) --kind extrapolation --out $(DEMO)/figures
	$(BIN)/relpos-ablate plot $(DEMO) --kind bias --out $(DEMO)/figures
	run=$$($(DEMO_FIRST_RUN)) && for kind in terms attention; do \
		$(BIN)/relpos-ablate plot $(DEMO)/$$run --kind $$kind --out $(DEMO)/figures || exit 1; done

# lengthgen: train experiments/length_generalization.yaml (done runs are skipped), then write its report
# results/length_generalization/{summary.csv,table.md,table.tex,figures/}; README.md there holds the
# measured wall time and the comparison with the papers.
LENGTHGEN := results/length_generalization

lengthgen: install
	$(call report,length_generalization)
	$(BIN)/relpos-ablate plot $(LENGTHGEN) --kind diagnostics --out $(LENGTHGEN)/figures
	$(BIN)/relpos-ablate plot $(LENGTHGEN) --kind passkey --out $(LENGTHGEN)/figures

bench: install
	$(BIN)/python benchmarks/attention.py

clean:
	rm -rf $(VENV) .pytest_cache
