"""TensorBoard and Weights & Biases for a run (train.loggers), from rank 0 through Lightning's own
loggers.

metrics.csv (train/records.py) is always written and stays the run's record; these show the same
metrics where people follow long runs. Each is an optional extra: a missing one is a one-line error.
A grid's runs of one variant (every axis value but the seed) are grouped where each tool groups
runs, so a logged grid reads as `table` does: TensorBoard's HParams shows one session group per
variant (its axes the hyperparameters, the seed a metric), W&B one `group` per variant.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from relpos_ablate import rundir
from relpos_ablate.config import ConfigError, RunConfig
from relpos_ablate.config.schedule import shown_value

SEED = "seed"
"""The variant axis that repeats a variant (runner/axes.py SEED): left out of its group."""


def logged_identity(run_dir: Path) -> tuple[str, dict]:
    """(run id, variant) under which TensorBoard and W&B show the run: run.json's (grid runs), else
    the run directory's name and no variant."""
    info = rundir.read_run_info(run_dir) or {}
    return info.get("run_id", run_dir.name), info.get("variant") or {}


def variant_group(variant: dict) -> str:
    """The name of a variant's group: its axis values but the seed, as the runner prints them
    (`encoding=xl model.mem_len=64`; `(base)` for a grid of seeds alone); '' for no variant (a run
    trained by `train` alone, grouped with nothing)."""
    if not variant:
        return ""
    kept = {key: value for key, value in variant.items() if key != SEED}
    return " ".join(f"{key}={shown_value(value)}" for key, value in kept.items()) or "(base)"


def variant_hparams(variant: dict) -> dict[str, Any]:
    """The variant's axes but the seed as HParams values (numbers, booleans and strings as they
    are; a list or mapping as the runner prints it)."""
    return {
        key: value if isinstance(value, (bool, int, float, str)) else shown_value(value)
        for key, value in variant.items()
        if key != SEED
    }


class VariantTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoard logger whose HParams entry is the run's variant: the session's
    hyperparameters are the variant's axes but the seed, its group the variant (TensorBoard puts
    sessions of one group_name in one row: all of a variant's seeds), and the seed a scalar at step
    0, a metric column of the group. hparams.yaml still holds the config and the run."""

    def __init__(self, *args, variant: dict, experiment: str | None, seed: int, **kwargs):
        # no hp_metric placeholder: Lightning's own HParams summary (every config field, one group
        # per run) is not written
        super().__init__(*args, default_hp_metric=False, **kwargs)
        group = variant_group(variant)
        self._session = (
            variant_hparams(variant),
            f"{experiment}: {group}" if group and experiment else group,
            seed,
        )

    @rank_zero_only
    def log_hyperparams(self, params, metrics=None, step=None) -> None:
        super().log_hyperparams(params, metrics, step)
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.hparams import metadata, plugin_data_pb2

        hparams, group, seed = self._session
        info = plugin_data_pb2.SessionStartInfo(group_name=group, start_time_secs=time.time())
        for key, value in hparams.items():
            field = info.hparams[key]
            if isinstance(value, bool):
                field.bool_value = value
            elif isinstance(value, (int, float)):
                field.number_value = value
            else:
                field.string_value = value
        content = plugin_data_pb2.HParamsPluginData(session_start_info=info)
        summary = Summary(
            value=[
                Summary.Value(
                    tag=metadata.SESSION_START_INFO_TAG,
                    metadata=metadata.create_summary_metadata(content),
                )
            ]
        )
        # no experiment summary: TensorBoard then builds the HParams columns from every session of
        # the log dir (each run's variant axes, every scalar), not from the one run that wrote it
        self.experiment._get_file_writer().add_summary(summary)
        self.log_metrics({SEED: seed}, 0)


def make_loggers(config: RunConfig, run_dir: Path, resume_step: int) -> list:
    """TensorBoard and W&B loggers asked for in train.loggers (metrics.csv is always written): the
    run id names the run, the grid's varying fields are W&B tags (and, with the config,
    hyperparameters), the variant (every field but the seed) groups the runs of one variant, and a
    resumed run continues the same logged run. A missing extra is a one-line ConfigError."""
    name, variant = logged_identity(run_dir)
    experiment = (rundir.read_run_info(run_dir) or {}).get("experiment")
    loggers = []
    if "tensorboard" in config.train.loggers:
        _need_extra("tensorboard")
        # every attempt logs into the same dir; events past the resumed step are dropped, as
        # metrics.csv rows are
        loggers.append(
            VariantTensorBoardLogger(
                save_dir=run_dir,
                name=rundir.TENSORBOARD,
                version="",
                purge_step=resume_step or None,
                variant=variant,
                experiment=experiment,
                seed=config.seed,
            )
        )
    if "wandb" in config.train.loggers:
        _need_extra("wandb")
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(
            WandbLogger(
                name=name,
                id=name,
                resume="allow",
                project=experiment or "relpos-ablate",
                # the project is the experiment: a group per variant within it
                group=variant_group(variant) or None,
                save_dir=str(run_dir),
                tags=[f"{key}={value}" for key, value in variant.items()],
            )
        )
    return loggers


def _need_extra(package: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            "train.loggers", f"{package} is not installed; pip install relpos-ablate[{package}]"
        )


def checkpoint_step(run_dir: Path) -> int:
    """The global step last.ckpt resumes from (there must be one); memory-mapped, so cheap at any
    size."""
    checkpoint = torch.load(
        rundir.last_checkpoint(run_dir), map_location="cpu", mmap=True, weights_only=True
    )
    return int(checkpoint["global_step"])


@contextlib.contextmanager
def wandb_run_ends_with_the_attempt(config: RunConfig):
    """W&B keeps its run open for the whole Python process (Lightning's logger does not finish it):
    end it with the attempt, marked failed unless the attempt completed, so the next run in this
    process gets its own."""
    exit_code = 1
    try:
        yield
        exit_code = 0
    finally:
        if "wandb" in config.train.loggers and importlib.util.find_spec("wandb") is not None:
            import wandb

            if wandb.run is not None:
                wandb.finish(exit_code=exit_code)
