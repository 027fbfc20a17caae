# make test  — create .venv (torch CPU wheel first), install the project, run the test suite (2 pytest-xdist
#   workers, then the multi-process DDP tests alone; PYTEST_WORKERS, PYTEST_ARGS)
# make demo  — run the demo ablation grid (experiments/demo.yaml) and write results/demo/
# make docs  — build the documentation site into site/ (mkdocs build --strict); make lint — ruff check and format --check
# make gpu-check — on a CUDA machine: parity, DDP, attention timing, train-step MFU, one process per phase; each
#   call fits 10 min and resumes where the last one stopped (benchmarks/gpu_check.py; flags: GPU_CHECK_ARGS=...);
#   without a GPU it says so in one line
# make lengthgen, make repro-extrapolation, make repro-xl — the reproductions (README "Reproductions": their measured
#   costs on 2 CPU cores)
# make fair-baselines — every encoding preset at its own best learning rate (README "Fair baselines")
# make hybrid-schedules — per-layer schedules (RNoPE, Llama-4-like, Gemma-3-like) on text and a long-context task
# make attention-plumbing — NoPE, RoPE, ALiBi, FoX with and without QK-norm, an output gate, a sink logit, Canon
# make packed-documents — the fair-baselines core on BPE tokens, documents concatenated vs packed with resets
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c  # a failed grid fails its target even when piped through tee
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2

.PHONY: install test demo docs lint bench gpu-check clean lengthgen repro-extrapolation repro-xl fair-baselines hybrid-schedules attention-plumbing packed-documents

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

# test: the suite on PYTEST_WORKERS pytest-xdist workers (one torch thread each), then the tests that start a
# process group (marker process_group) alone: their ranks wait on each other every step and slow down many
# times over when other tests share the cores. A pytest that selects no test (exit 5, e.g. PYTEST_ARGS names
# one file) is fine as long as the other one ran tests. Without PYTEST_ARGS the second pytest collects only the
# files that name the marker (GROUP_FILES), not the whole suite again (~13 s on 2 cores).
GROUP_FILES = $(sort $(shell grep -rl --include='test_*.py' 'mark\.process_group' tests))
test: install
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal --process-groups=skip $(PYTEST_ARGS); \
		rest=$$?; [ $$rest = 0 ] || [ $$rest = 5 ] || exit $$rest; \
	$(BIN)/python -m pytest --process-groups=only $(or $(PYTEST_ARGS),$(GROUP_FILES)); \
		groups=$$?; [ $$groups = 5 ] && exit $$rest; exit $$groups

# demo: train the grid (done runs are skipped, so a rerun only redraws), then write the report files
# $(DEMO_OUT)/{summary.csv,table.md,table.tex,figures/} and compare the table with the committed one. The
# report of your runs goes to results/demo/local/ (gitignored), so `make demo` leaves `git status` clean:
# results/demo/ holds the committed reference (its last digits differ on another machine), which
# `make demo DEMO_OUT=results/demo` rewrites. The run dirs with their checkpoints stay local, so on a fresh
# clone `make demo` retrains (27 runs, ~5 min on 2 cores).
DEMO := results/demo
DEMO_OUT ?= $(DEMO)/local
DEMO_FIRST_RUN = $(BIN)/python -c "from relpos_ablate.runner.grid import load_grid; \
	print(load_grid('experiments/demo.yaml').runs[0].run_id)"

demo: install
	$(BIN)/relpos-ablate grid experiments/demo.yaml --slots 2 --results results
	$(BIN)/relpos-ablate collect $(DEMO) --out $(DEMO_OUT)/summary.csv
	$(BIN)/relpos-ablate table $(DEMO) --out $(DEMO_OUT)/table.md
	$(BIN)/relpos-ablate table $(DEMO) --out $(DEMO_OUT)/table.tex
	$(BIN)/relpos-ablate plot $(DEMO) --kind extrapolation --out $(DEMO_OUT)/figures
	$(BIN)/relpos-ablate plot $(DEMO) --kind bias --out $(DEMO_OUT)/figures
	run=$$($(DEMO_FIRST_RUN)) && for kind in terms attention; do \
		$(BIN)/relpos-ablate plot $(DEMO)/$$run --kind $$kind --out $(DEMO_OUT)/figures || exit 1; done
	@if cmp -s $(DEMO)/table.md $(DEMO_OUT)/table.md; then \
		echo "$(DEMO_OUT)/table.md: the same as the committed $(DEMO)/table.md"; \
	else echo "$(DEMO_OUT)/table.md against the committed $(DEMO)/table.md (another machine may differ in"; \
		echo "the last digit: docs/reproductions.md#demo):"; diff $(DEMO)/table.md $(DEMO_OUT)/table.md || true; fi

# Reproductions (README "Reproductions"): train a spec's grid on 2 CPU slots (done runs are skipped), then
# write its report into results/<name>/: summary.csv, the tables, figures/ and grid.txt (the grid's last
# line, with its wall time, and the machine, appended when the grid trained something: one part per invocation). Only the
# report files are committed (.gitignore): summary.csv keeps the committed rows of the runs this machine has
# no run dir of (`collect --merge`) and drops those the spec (and the extra specs of argument 2) no longer
# plans (`--spec`), so adding seeds to a study trains only the new runs.
define repro_grid
	mkdir -p results/$(1)
	$(BIN)/relpos-ablate grid experiments/$(1).yaml --slots 2 --results results 2>&1 | tee results/$(1)/.grid.out
	if ! grep -q "ran 0 in" results/$(1)/.grid.out; then \
		{ grep "^grid $(1):" results/$(1)/.grid.out | tail -n 1; \
		  echo "machine: $$(nproc) CPU cores, $$(lscpu | sed -n 's/^Model name: *//p'), $$(date -u +%F)"; \
		} >> results/$(1)/grid.txt; fi
	rm -f results/$(1)/.grid.out
	$(BIN)/relpos-ablate collect results/$(1) $$(test -f results/$(1)/summary.csv && echo --merge results/$(1)/summary.csv) \
		--spec experiments/$(1).yaml $(2) --out results/$(1)/summary.csv
endef
LENGTHGEN := results/length_generalization
LENGTHCAP := results/length_generalization_cap
EXTRAP := results/alibi_extrapolation_cpu
XL6 := results/xl_table6_cpu
XLCTX := results/xl_context_cpu

# lengthgen: report.md from the summary.csvs it commits, so the report regenerates from committed data alone;
# length_generalization_cap trains the slow learners again with the step cap doubled (the report's last section)
lengthgen: install
	$(call repro_grid,length_generalization)
	$(call repro_grid,length_generalization_cap)
	$(BIN)/relpos-ablate table $(LENGTHGEN)/summary.csv --out $(LENGTHGEN)/table.md
	$(BIN)/relpos-ablate table $(LENGTHGEN)/summary.csv --out $(LENGTHGEN)/table.tex
	$(BIN)/relpos-ablate report $(LENGTHGEN)/summary.csv $(LENGTHCAP)/summary.csv --out $(LENGTHGEN)/report.md
	for kind in lengthgen diagnostics passkey; do \
		$(BIN)/relpos-ablate plot $(LENGTHGEN) --kind $$kind --out $(LENGTHGEN)/figures || exit 1; done

# ALiBi App. B on the trained runs (no retraining): windows of L = 64 moved by 1 ... 64 tokens, and non-overlapping
# segments of 2L and 4L, all on the first APPB_TARGETS targets (stride 1 costs one forward per target); appb.txt
# records its wall time when it evaluated something. table.md keeps the full-target settings (the spec's
# `table: where`), table_appb.md the sweep.
APPB_TARGETS := 2048
# The exact-context ladder beside it (windows of c = 16 ... 64 moved by 1, every target's loss saved): the
# report's "loss at an exact context" compares them on the targets all of them score in full (collect's ladder_loss).
APPB_SETTINGS := [$(foreach s,2 4 8 16 32 64,{segment_len: 64, protocol: sliding, stride: $(s), \
	max_targets: $(APPB_TARGETS)},) {segment_len: 128, max_targets: $(APPB_TARGETS)}, \
	{segment_len: 256, max_targets: $(APPB_TARGETS)}, $(foreach c,16 24 32 40 48 56 64,{segment_len: $(c), \
	protocol: sliding, stride: 1, max_targets: $(APPB_TARGETS), token_losses: true},)]

repro-extrapolation: install
	$(call repro_grid,alibi_extrapolation_cpu)
	start=$$(date +%s); $(BIN)/relpos-ablate evaluate $(EXTRAP) --slots 2 --set 'eval.settings=$(APPB_SETTINGS)' \
		| tee $(EXTRAP)/.appb.out; \
	if grep -q "evaluated [1-9]" $(EXTRAP)/.appb.out; then \
		echo "evaluate (App. B, max_targets $(APPB_TARGETS)): $$(grep -c "evaluated [1-9]" $(EXTRAP)/.appb.out) runs in $$(( $$(date +%s) - start )) s on 2 slot(s); machine: $$(nproc) CPU cores, $$(date -u +%F)" \
			> $(EXTRAP)/appb.txt; fi; rm -f $(EXTRAP)/.appb.out
	$(BIN)/relpos-ablate collect $(EXTRAP) --merge $(EXTRAP)/summary.csv --spec experiments/alibi_extrapolation_cpu.yaml \
		--out $(EXTRAP)/summary.csv
	$(BIN)/relpos-ablate table $(EXTRAP)/summary.csv --out $(EXTRAP)/table.md
	$(BIN)/relpos-ablate table $(EXTRAP)/summary.csv --where max_targets=$(APPB_TARGETS) --cols protocol segment_len stride \
		--out $(EXTRAP)/table_appb.md
	$(BIN)/relpos-ablate report $(EXTRAP)/summary.csv --out $(EXTRAP)/report.md
	$(BIN)/relpos-ablate plot $(EXTRAP) --kind extrapolation --y ratio --out $(EXTRAP)/figures
	$(BIN)/relpos-ablate plot $(EXTRAP) --kind position-loss --out $(EXTRAP)/figures

# repro-xl: first how much context a model without memory uses at this budget (xl_context_cpu), which sets
# the Table 6 study's segment length, then Tables 6 and 8 and the report of their comparisons.
repro-xl: install
	$(call repro_grid,xl_context_cpu)
	$(BIN)/relpos-ablate table $(XLCTX)/summary.csv --out $(XLCTX)/table.md
	$(BIN)/relpos-ablate report $(XLCTX)/summary.csv --out $(XLCTX)/report.md
	$(call repro_grid,xl_table6_cpu)
	$(BIN)/relpos-ablate table $(XL6)/summary.csv $(XLCTX)/summary.csv --layout xl_table6 --out $(XL6)/table6.md
	$(BIN)/relpos-ablate table $(XL6) --layout xl_table8 --out $(XL6)/table8.md
	$(BIN)/relpos-ablate table $(XL6) --layout xl_table8 --where model.mem_len=48 --out $(XL6)/table8_memory.md
	$(BIN)/relpos-ablate report $(XL6)/summary.csv $(XLCTX)/summary.csv --out $(XL6)/report.md
	$(BIN)/relpos-ablate plot $(XL6)/summary.csv --kind context --out $(XL6)/figures

# fair-baselines: table.md is the spec's best_over table (test ppl at each preset's best-validation lr); report.md
# the counts and the tests (Holm-corrected families), from the committed summary.csvs alone: the sweep's, then
# fair_baselines_2000's (some presets at their pick for 2000 steps: the report's last section)
FAIR := results/fair_baselines

fair-baselines: install
	$(call repro_grid,fair_baselines)
	$(call repro_grid,fair_baselines_2000)
	$(BIN)/relpos-ablate table $(FAIR)/summary.csv --out $(FAIR)/table.md
	$(BIN)/relpos-ablate report $(FAIR)/summary.csv $(FAIR)_2000/summary.csv --out $(FAIR)/report.md
	$(BIN)/relpos-ablate plot $(FAIR)/summary.csv --kind lr-sweep --out $(FAIR)/figures

# hybrid-schedules: the per-layer schedule study (text and the long-context task, which no schedule
# learnt: its report says so and ranks nothing), one report over both
HYBRID := results/hybrid_schedules
hybrid-schedules: install
	$(call repro_grid,hybrid_schedules)
	$(call repro_grid,hybrid_schedules_retrieval)
	$(BIN)/relpos-ablate table $(HYBRID)/summary.csv --out $(HYBRID)/table.md
	$(BIN)/relpos-ablate report $(HYBRID)/summary.csv $(HYBRID)_retrieval/summary.csv --out $(HYBRID)/report.md
	$(BIN)/relpos-ablate plot $(HYBRID)/summary.csv --kind extrapolation --y ratio --out $(HYBRID)/figures

# attention-plumbing: does the ranking of NoPE, RoPE, ALiBi and FoX survive QK-norm, an output gate, a sink
# logit and Canon? (issue 59; its analysis plan declared before the first run)
# repro_study: a study whose figure reads its run dirs: the grid, then its figure (kind $(2)), table and report
define repro_study
	$(call repro_grid,$(1))
	$(BIN)/relpos-ablate plot results/$(1) --kind $(2) --out results/$(1)/figures
	$(BIN)/relpos-ablate table results/$(1)/summary.csv --out results/$(1)/table.md
	$(BIN)/relpos-ablate report results/$(1)/summary.csv --out results/$(1)/report.md
endef
attention-plumbing: install
	$(call repro_study,attention_plumbing,plumbing)

# packed-documents: what changes when positions restart per document? NoPE, the sinusoid, RoPE, ALiBi, T5, FoX,
# XL on BPE tokens of Tiny Shakespeare, documents concatenated or packed with resets (issue 60; its analysis
# plan declared before the first run)
packed-documents: install
	$(call repro_study,packed_documents,documents)

# docs: the site into site/; --strict turns a broken link, a missing page or a docstring the API reference
# cannot read into an error (the docs' runnable blocks and named paths are tests: tests/test_docs.py)
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python benchmarks/attention.py

gpu-check: install
	$(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache site
