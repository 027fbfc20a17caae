"""One run in one run directory: train (resuming from checkpoints/last.ckpt), evaluate every
setting, record everything (the file names: relpos_ablate/rundir.py; the contract:
docs/architecture.md).

`train_run(config, run_dir)` is what `relpos-ablate train` calls. The Trainer it builds:
train/trainer.py; `load_run(run_dir)`, which gives the analysis layer the trained model back, and
the checkpoint it resumes from: train/checkpoints.py (both importable from here too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import signal
import time
import traceback
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from relpos_ablate import rundir
from relpos_ablate.config import ConfigError, RunConfig, TrainConfig, check_world_size, to_plain
from relpos_ablate.config.run import resolve_log_n_length
from relpos_ablate.io import atomic_write_json, atomic_write_yaml
from relpos_ablate.train.checkpoints import (  # noqa: F401 (API: load_run, the tests)
    load_run,
    load_weights,
    usable_checkpoint,
)
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.evaluation import evaluate, write_token_losses
from relpos_ablate.train.loggers import (
    checkpoint_step,
    logged_identity,
    make_loggers,
    wandb_run_ends_with_the_attempt,
)
from relpos_ablate.train.module import LitLM, NonFiniteLoss
from relpos_ablate.train.records import (
    CONFIG_ERRORS,
    AtomicCheckpointIO,
    MetricsCSV,
    RunRecorder,
    RunStatus,
    close_log,
    open_log,
)
from relpos_ablate.train.stopping import StopAtExactMatch
from relpos_ablate.train.trainer import (  # noqa: F401 (API: the tests, evaluate_run)
    StopOnSigterm,
    cluster_environment,
    make_trainer,
    quiet_known_warnings,
)

log = logging.getLogger("relpos_ablate.train")


def resolve_vocab(config: RunConfig, data_vocab: int) -> RunConfig:
    """Fill model.vocab_size from the data; a different explicit value is an error."""
    if config.model.vocab_size == 0:
        return dataclasses.replace(
            config, model=dataclasses.replace(config.model, vocab_size=data_vocab)
        )
    if config.model.vocab_size != data_vocab:
        raise ConfigError(
            "model.vocab_size",
            f"{config.model.vocab_size} but the data has {data_vocab} tokens; "
            "use 0 to take it from the data",
        )
    return config


def train_run(
    config: RunConfig,
    run_dir: str | Path,
    callbacks: tuple[L.Callback, ...] = (),
    started: float | None = None,
) -> str:
    """Train, evaluate and record one run; returns its final state: done | failed | interrupted.

    A done run is left alone. Anything else resumes from checkpoints/last.ckpt when it exists.
    `callbacks` are extra Lightning callbacks (tests use one to interrupt a run). With several
    processes every one of them calls this; only rank 0 writes the run's records, the others let
    their errors end their process (Lightning then stops the whole run). `started`: time.monotonic()
    when the command began, so the attempt's wall time counts its start-up (imports, data) too;
    default now.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if rundir.is_done(run_dir):
        return "done"
    if not launched_as_rank_zero():
        _train_and_evaluate(config, run_dir, None, callbacks)
        return "done"
    handler = open_log(run_dir)
    status = RunStatus(run_dir)
    status.start(
        device=describe_device(config.train), max_steps=config.train.max_steps, since=started
    )
    try:
        with wandb_run_ends_with_the_attempt(config):
            _train_and_evaluate(config, run_dir, status, callbacks)
        status.finish("done")
        return "done"
    # Lightning turns Ctrl-C into SystemExit(1)
    except (KeyboardInterrupt, SystemExit, LostProcess) as err:
        reason = (
            str(err)
            if isinstance(err, LostProcess)
            else (
                "stopped by SIGTERM"
                if isinstance(err, SIGTERMException)
                else "interrupted by the user"
            )
            + "; rerun the same command to resume"
        )
        log.warning("%s (at step %s)", reason, status.fields.get("step"))
        status.finish("interrupted", reason=reason)
        return "interrupted"
    except Exception as err:  # the run failed: record why, for the runner and the collector
        reason = (
            str(err)
            if isinstance(err, (NonFiniteLoss, ConfigError))
            else f"{type(err).__name__}: {err}"
        )
        reason = " ".join(reason.split())
        log.error("failed: %s\n%s", reason, traceback.format_exc())
        bad_input = (
            {CONFIG_ERRORS: [str(e) for e in err.errors]} if isinstance(err, ConfigError) else {}
        )
        status.finish("failed", reason=reason, traceback=traceback.format_exc(), **bad_input)
        return "failed"
    finally:
        close_log(handler)


def launched_as_rank_zero() -> bool:
    """Whether this process is rank 0 of its run, known before the Trainer exists: the processes of
    a multi-process run are started with their rank in RANK (torchrun), SLURM_PROCID (SLURM tasks)
    or NODE_RANK / LOCAL_RANK (Lightning's own launcher); a single process has none of them set."""
    return all(
        int(os.environ.get(name) or 0) == 0
        for name in ("RANK", "SLURM_PROCID", "NODE_RANK", "LOCAL_RANK")
    )


def describe_device(train: TrainConfig) -> str:
    processes = (
        ""
        if train.devices == 1 and train.num_nodes == 1
        else (
            f" x {train.devices} per node"
            + (f" x {train.num_nodes} nodes" if train.num_nodes > 1 else "")
        )
    )
    if train.accelerator != "cpu" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()}){processes}"
    return f"cpu{processes}"


def _train_and_evaluate(
    config: RunConfig, run_dir: Path, status: RunStatus | None, callbacks
) -> None:
    """The run itself; `status` is None on ranks > 0, which write no records."""
    datamodule = build_datamodule(config)
    datamodule.prepare_data()
    datamodule.check_evaluation()
    config = resolve_log_n_length(resolve_vocab(config, datamodule.vocab_size))
    if status is not None:
        atomic_write_yaml(run_dir / rundir.CONFIG, to_plain(config))
    L.seed_everything(config.seed, workers=True, verbose=False)
    module = LitLM(config)
    module.separator = datamodule.separator
    name, variant = logged_identity(run_dir)
    # TensorBoard / W&B show the run's id and variant next to its config (Lightning logs the
    # hyperparameters)
    module.save_hyperparameters({**module.hparams, "run": {"id": name, "variant": variant}})
    resume = usable_checkpoint(run_dir, tidy=status is not None)
    first_step = checkpoint_step(run_dir) if resume else 0
    # not the step an earlier attempt reached: this one starts from its checkpoint
    if status is not None:
        status.update(step=first_step)
    metrics = MetricsCSV(run_dir)
    loggers = [metrics, *make_loggers(config, run_dir, first_step)]
    checkpoints = AtomicCheckpointIO()
    recorders = (
        [RunRecorder(status, metrics, checkpoints, config.train.log_every)]
        if status is not None
        else []
    )
    stopper = (
        StopAtExactMatch(config, rundir.last_checkpoint(run_dir))
        if config.train.stop_at_exact_match is not None
        else None
    )
    trainer = make_trainer(
        config,
        run_dir,
        loggers,
        [*recorders, *([stopper] if stopper else []), *callbacks],
        checkpoints,
    )
    check_world_size(config, trainer.world_size)
    # same initial weights everywhere, but each process its own dropout draws
    if trainer.world_size > 1:
        torch.manual_seed(config.seed + DROPOUT_SEED_STRIDE * trainer.global_rank)
    log.info(
        "run %s: %d parameters, %s, %d process(es)",
        run_dir,
        sum(p.numel() for p in module.model.parameters()),
        describe_device(config.train),
        trainer.world_size,
    )
    with warnings.catch_warnings(), _lost_process_interrupts(trainer):
        quiet_known_warnings()
        trainer.fit(module, datamodule=datamodule, ckpt_path="last" if resume else None)
        log.info(
            "trained to step %d; evaluating %d settings", trainer.global_step, len(module.settings)
        )
        results, token_losses = evaluate(trainer, module, datamodule, config)
    _leave_process_group(trainer)
    if stopper is not None:
        results["stopped"] = stopper.record(trainer.global_step)
    if status is not None:  # one process writes the records
        if stopper is not None:
            status.update(step=trainer.global_step, stopped=results["stopped"]["reason"])
        if token_losses:
            write_token_losses(run_dir / rundir.TOKEN_LOSSES, token_losses)
        atomic_write_json(run_dir / rundir.EVAL, results)


def _leave_process_group(trainer: L.Trainer) -> None:
    """End a multi-process run's process group once every process is past its last collective (the
    evaluation), with the DDP wrapper Lightning dropped after fit collected first. Left to the
    interpreter's exit, the group and gloo's threads went in whatever order the exit took: a process
    then aborted now and then ('terminate called without an active exception', SIGABRT after
    `Trainer.fit` ended; Lightning then kills the run's other processes), or hung
    (test_ddp_parameters.py)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    trainer.strategy.barrier("leave_process_group")
    gc.collect()
    torch.distributed.destroy_process_group()


class LostProcess(RuntimeError):
    """Another process of the run died (killed, out of memory): the run is interrupted, not failed,
    and a rerun resumes it from last.ckpt."""


@contextlib.contextmanager
def _lost_process_interrupts(trainer: L.Trainer, wait_s: float = 1.0):
    """An error caused by the death of a process Lightning launched for this run (the collective it
    was in fails with 'connection reset by peer') becomes LostProcess, naming the process and its
    exit."""
    try:
        yield
    except Exception as err:
        launched = list(enumerate(getattr(trainer.strategy.launcher, "procs", ()), start=1))
        deadline = time.monotonic() + wait_s  # the error can come before the dead process is reaped
        while launched:
            dead = [
                (rank, proc.returncode) for rank, proc in launched if proc.poll() not in (None, 0)
            ]
            if dead:
                rank, code = dead[0]
                how = signal.Signals(-code).name if code < 0 else f"exit status {code}"
                raise LostProcess(
                    f"process of local rank {rank} died ({how}); rerun to resume"
                ) from err
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        raise


DROPOUT_SEED_STRIDE = 1_000_003
"""Process r of a multi-process run reseeds its dropout with seed + r * this (distinct for any
seed)."""
