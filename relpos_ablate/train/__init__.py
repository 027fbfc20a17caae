"""One run: data (synthetic tasks, text via datasets), the LightningModule, and the run directory.

Entry points: `relpos_ablate.train.run.train_run(config, run_dir)` (what `relpos-ablate train`
calls), `relpos_ablate.train.run.load_run(run_dir)` and
`relpos_ablate.train.data.sample_inputs(...)` for analysis.
"""
