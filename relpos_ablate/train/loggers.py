"""TensorBoard and Weights & Biases for a run (train.loggers), from rank 0 through Lightning's own
loggers.

metrics.csv (train/records.py) is always written and stays the run's record; these show the same
metrics where people follow long runs. Each is an optional extra: a missing one is a one-line error.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import torch

from relpos_ablate import rundir
from relpos_ablate.config import ConfigError, RunConfig


def logged_identity(run_dir: Path) -> tuple[str, dict]:
    """(run id, variant) under which TensorBoard and W&B show the run: run.json's (grid runs), else
    the run directory's name and no variant."""
    info = rundir.read_run_info(run_dir) or {}
    return info.get("run_id", run_dir.name), info.get("variant") or {}


def make_loggers(config: RunConfig, run_dir: Path, resume_step: int) -> list:
    """TensorBoard and W&B loggers asked for in train.loggers (metrics.csv is always written): the
    run id names the run, the grid's varying fields are W&B tags (and, with the config,
    hyperparameters), and a resumed run continues the same logged run. A missing extra is a one-line
    ConfigError."""
    name, variant = logged_identity(run_dir)
    loggers = []
    if "tensorboard" in config.train.loggers:
        _need_extra("tensorboard")
        from lightning.pytorch.loggers import TensorBoardLogger

        # every attempt logs into the same dir; events past the resumed step are dropped, as
        # metrics.csv rows are
        loggers.append(
            TensorBoardLogger(
                save_dir=run_dir,
                name=rundir.TENSORBOARD,
                version="",
                purge_step=resume_step or None,
            )
        )
    if "wandb" in config.train.loggers:
        _need_extra("wandb")
        from lightning.pytorch.loggers import WandbLogger

        project = (rundir.read_run_info(run_dir) or {}).get("experiment") or "relpos-ablate"
        loggers.append(
            WandbLogger(
                name=name,
                id=name,
                resume="allow",
                project=project,
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
