"""The Lightning Trainer a run trains with: its checkpointing (checkpoints/last.ckpt, also on
SIGTERM), how its processes find each other, and the warnings that do not apply to this layout.

`make_trainer` is what `train_run` (train/run.py) builds; `StopOnSigterm` stops every process of a
run at the same step.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
)
from lightning.pytorch.utilities.exceptions import SIGTERMException

from relpos_ablate import rundir
from relpos_ablate.config import RunConfig, TrainConfig
from relpos_ablate.train.records import AtomicCheckpointIO

# Lightning advertises a hosted logger on every run; keep run logs to what concerns the run.
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
    lambda record: "litlogger" not in record.getMessage()
)


def make_trainer(
    config: RunConfig,
    run_dir: Path,
    loggers: list,
    callbacks: list[L.Callback],
    checkpoints: AtomicCheckpointIO,
) -> L.Trainer:
    t = config.train
    last = rundir.last_checkpoint(run_dir)
    checkpoint = ModelCheckpoint(
        dirpath=last.parent,
        save_last=True,
        save_top_k=0,
        every_n_train_steps=t.checkpoint_every,
        enable_version_counter=False,
    )
    checkpoint.CHECKPOINT_NAME_LAST = last.stem  # Lightning appends FILE_EXTENSION (.ckpt)
    interactive = sys.stdout.isatty()
    callbacks = [checkpoint, StopOnSigterm(last), *callbacks]
    if interactive:
        callbacks.append(RichProgressBar())
    return L.Trainer(
        default_root_dir=run_dir,
        max_steps=t.max_steps,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=t.strategy,
        accumulate_grad_batches=t.accumulate,
        precision=t.precision,
        gradient_clip_val=t.grad_clip or None,
        deterministic=t.deterministic,
        logger=loggers,
        log_every_n_steps=t.log_every,
        callbacks=callbacks,
        enable_progress_bar=interactive,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        val_check_interval=t.val_every or None,
        check_val_every_n_epoch=None if t.val_every else 1,
        plugins=[*cluster_environment(t), checkpoints],
    )


def cluster_environment(train: TrainConfig) -> list[ClusterEnvironment]:
    """How this process finds the others. Inside a SLURM job step that started one task per process
    of the run (`grid --launcher slurm` submits them so), Lightning's SLURMEnvironment, with its own
    auto-requeue off: submitit requeues the job (runner/slurm.py), and two requeues would race. A
    process started any other way inside a SLURM allocation (a local grid on an allocated node)
    starts the others itself: LightningEnvironment. Outside SLURM Lightning detects torchrun or
    launches the processes itself (empty list)."""
    if not SLURMEnvironment.detect():
        return []
    tasks = int(os.environ.get("SLURM_NTASKS", 1))
    if train.devices == "auto" or tasks == train.devices * train.num_nodes:
        return [SLURMEnvironment(auto_requeue=False)]
    return [LightningEnvironment()]


class StopOnSigterm(L.Callback):
    """SIGTERM (preemption, the runner stopping) stops the run at the end of the current step, on
    every process at the same step, and keeps that step's progress by writing last.ckpt before
    exiting.

    Lightning's own handling hangs a multi-process run (seen with 2 CPU processes and gloo): its
    handler forwards the signal and broadcasts from inside the handler, and each process checks its
    own flag at the end of a step, so processes signalled a moment apart stop at different steps and
    wait in different collectives. Here the handler only notes the signal; at the end of each step
    the processes agree (one all-reduce) whether any was signalled, then Lightning stops them all.
    During evaluation a multi-process run finishes the evaluation first."""

    def __init__(self, path: Path):
        self.path = path
        self.signalled = False

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self._handle_sigterm(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module) -> None:
        self._handle_sigterm(trainer)

    def _handle_sigterm(self, trainer: L.Trainer) -> None:
        """Replaces the handler Lightning installed for this stage (it restores the previous one
        after)."""

        def note(signum, frame) -> None:
            self.signalled = True
            if trainer.world_size == 1:
                _stop_lightning(trainer)

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, note)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int
    ) -> None:
        if trainer.world_size > 1:
            anyone = torch.tensor(float(self.signalled), device=trainer.strategy.root_device)
            if trainer.strategy.reduce(anyone, reduce_op="sum").item() > 0:
                _stop_lightning(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(self.path, weights_only=False)


def _stop_lightning(trainer: L.Trainer) -> None:
    """Lightning's flag (no public setter; trainer.received_sigterm reads it): the loop stops after
    this step."""
    trainer._signal_connector.received_sigterm = True


def quiet_known_warnings() -> None:
    """Warnings that do not apply to this layout: batches are slices of in-memory tensors (no
    workers needed) and the training loader resumes from the global step itself."""
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
    warnings.filterwarnings("ignore", message=".*Total length of `list` across ranks is zero.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")
