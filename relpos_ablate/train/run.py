"""One run in one run directory: train (resuming from checkpoints/last.ckpt), evaluate every setting,
record everything (the file names: relpos_ablate/rundir.py; the contract: docs/architecture.md).

`train_run(config, run_dir)` is what `relpos-ablate train` calls; `load_run(run_dir)` gives the
analysis layer the trained model back.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import sys
import traceback
import warnings
import zipfile
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from relpos_ablate import rundir
from relpos_ablate.config import ConfigError, EvalSetting, RunConfig, to_plain
from relpos_ablate.config.run import resolve_log_n_length
from relpos_ablate.io import atomic_write_bytes, atomic_write_json, atomic_write_yaml
from relpos_ablate.model import TransformerLM
from relpos_ablate.train.data import SegmentDataModule, build_datamodule
from relpos_ablate.train.module import LitLM, NonFiniteLoss, main_metric, rope_scale
from relpos_ablate.train.records import MetricsCSV, RunRecorder, RunStatus, close_log, open_log

log = logging.getLogger("relpos_ablate.train")
# Lightning advertises a hosted logger on every run; keep run logs to what concerns the run.
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda record: "litlogger" not in record.getMessage())


def resolve_vocab(config: RunConfig, data_vocab: int) -> RunConfig:
    """Fill model.vocab_size from the data; a different explicit value is an error."""
    if config.model.vocab_size == 0:
        return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=data_vocab))
    if config.model.vocab_size != data_vocab:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} but the data has {data_vocab} tokens; "
                          "use 0 to take it from the data")
    return config


def unsupported_reason(config: RunConfig, setting: EvalSetting) -> str | None:
    """Why the model cannot be evaluated at `setting` (None when it can): learned absolute tables end;
    a RoPE context extension needs RoPE (and has no published form for xPos)."""
    a = config.model.attention
    if a.absolute in ("learned", "learned_per_layer") and setting.segment_len > a.max_position:
        return (f"learned absolute positions cover {a.max_position} tokens (model.attention.max_position); "
                f"segment_len {setting.segment_len} does not fit")
    if setting.rope_scaling is not None and (a.absolute != "rope" or a.xpos_scale_base is not None):
        return (f"rope_scaling {setting.rope_scaling!r} extends RoPE; this model has absolute={a.absolute!r}"
                + (" with xPos" if a.xpos_scale_base is not None else ""))
    return None


def train_run(config: RunConfig, run_dir: str | Path, callbacks: tuple[L.Callback, ...] = ()) -> str:
    """Train, evaluate and record one run; returns its final state: done | failed | interrupted.

    A done run is left alone. Anything else resumes from checkpoints/last.ckpt when it exists.
    `callbacks` are extra Lightning callbacks (tests use one to interrupt a run).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if rundir.is_done(run_dir):
        return "done"
    handler = open_log(run_dir)
    status = RunStatus(run_dir)
    status.start(device=describe_device(config.train.accelerator), max_steps=config.train.max_steps)
    try:
        _train_and_evaluate(config, run_dir, status, callbacks)
        status.finish("done")
        return "done"
    except (KeyboardInterrupt, SystemExit) as err:  # Lightning turns Ctrl-C into SystemExit(1)
        reason = "stopped by SIGTERM" if isinstance(err, SIGTERMException) else "interrupted by the user"
        log.warning("%s at step %s; rerun to resume", reason, status.fields.get("step"))
        status.finish("interrupted", reason=reason)
        return "interrupted"
    except Exception as err:  # the run failed: record why, for the runner and the collector
        reason = str(err) if isinstance(err, (NonFiniteLoss, ConfigError)) else f"{type(err).__name__}: {err}"
        reason = " ".join(reason.split())
        log.error("failed: %s\n%s", reason, traceback.format_exc())
        status.finish("failed", reason=reason, traceback=traceback.format_exc())
        return "failed"
    finally:
        close_log(handler)


def describe_device(accelerator: str) -> str:
    if accelerator != "cpu" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    return "cpu"


def _train_and_evaluate(config: RunConfig, run_dir: Path, status: RunStatus, callbacks) -> None:
    datamodule = build_datamodule(config)
    datamodule.prepare_data()
    config = resolve_log_n_length(resolve_vocab(config, datamodule.vocab_size))
    atomic_write_yaml(run_dir / rundir.CONFIG, to_plain(config))
    L.seed_everything(config.seed, workers=True, verbose=False)
    module = LitLM(config)
    log.info("run %s: %d parameters, %s", run_dir, sum(p.numel() for p in module.model.parameters()),
             describe_device(config.train.accelerator))
    metrics = MetricsCSV(run_dir)
    trainer = make_trainer(config, run_dir, metrics, [RunRecorder(status, metrics, config.train.log_every), *callbacks])
    with warnings.catch_warnings():
        _quiet_known_warnings()
        trainer.fit(module, datamodule=datamodule, ckpt_path="last" if usable_checkpoint(run_dir) else None)
        log.info("trained to step %d; evaluating %d settings", trainer.global_step, len(module.settings))
        atomic_write_json(run_dir / rundir.EVAL, evaluate(trainer, module, datamodule, config))


def usable_checkpoint(run_dir: Path) -> bool:
    """Whether there is a last.ckpt to resume from. Temp files of writes cut short by a kill are
    removed; a last.ckpt that is not a complete torch archive (damaged outside this code: every write
    here is atomic) is set aside as last.ckpt.corrupt and the run starts over, rather than failing
    again on every rerun."""
    last = rundir.last_checkpoint(run_dir)
    for stale in last.parent.glob(f".{last.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    if not last.exists():
        return False
    if zipfile.is_zipfile(last):
        return True
    last.replace(last.with_name(last.name + ".corrupt"))
    log.warning("%s is not a complete checkpoint; set aside as %s.corrupt, training from step 0", last, last.name)
    return False


def make_trainer(config: RunConfig, run_dir: Path, logger: MetricsCSV, callbacks: list[L.Callback]) -> L.Trainer:
    t = config.train
    last = rundir.last_checkpoint(run_dir)
    checkpoint = ModelCheckpoint(dirpath=last.parent, save_last=True, save_top_k=0,
                                 every_n_train_steps=t.checkpoint_every, enable_version_counter=False)
    checkpoint.CHECKPOINT_NAME_LAST = last.stem  # Lightning appends FILE_EXTENSION (.ckpt)
    interactive = sys.stdout.isatty()
    callbacks = [checkpoint, SaveOnSigterm(last), *callbacks]
    if interactive:
        callbacks.append(RichProgressBar())
    return L.Trainer(
        default_root_dir=run_dir, max_steps=t.max_steps, accelerator=t.accelerator, devices=1,
        precision=t.precision, gradient_clip_val=t.grad_clip or None, deterministic=t.deterministic,
        logger=logger, log_every_n_steps=t.log_every, callbacks=callbacks, enable_progress_bar=interactive,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        val_check_interval=t.val_every or None, check_val_every_n_epoch=None if t.val_every else 1,
        # the grid runner's submitit owns requeueing: no SLURM auto-requeue inside Lightning
        plugins=[LightningEnvironment(), AtomicCheckpointIO()],
    )


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written like every other run file (relpos_ablate.io): a temp file next to the
    target, fsync, rename. Lightning's own writer stages the file in $TMPDIR and moves it over, which
    is a copy, not a rename, when $TMPDIR is another filesystem (node-local /tmp, results on a shared
    disk): a kill during that copy left a truncated last.ckpt, and every kill a stray temp file."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(path, buffer.getvalue())


class SaveOnSigterm(L.Callback):
    """On SIGTERM (preemption, the runner stopping) Lightning stops after the batch; keep that batch's
    progress by writing last.ckpt before the process exits."""

    def __init__(self, path: Path):
        self.path = path

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            trainer.save_checkpoint(self.path, weights_only=False)


def _quiet_known_warnings() -> None:
    """Warnings that do not apply to this layout: batches are slices of in-memory tensors (no workers
    needed) and the training loader resumes from the global step itself."""
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
    warnings.filterwarnings("ignore", message=".*Total length of `list` across ranks is zero.*")
    warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")


def evaluate(trainer: L.Trainer, module: LitLM, datamodule: SegmentDataModule, config: RunConfig) -> dict:
    """eval.json: one record per setting with its metrics and attention length (segment_len + mem_len)."""
    settings = config.eval_settings()
    usable = [i for i, s in enumerate(settings) if unsupported_reason(config, s) is None]
    module.eval_indices = usable
    if usable:
        trainer.validate(module, dataloaders=[datamodule.eval_dataloader(settings[i]) for i in usable], verbose=False)
    records = []
    for i, setting in enumerate(settings):
        mem_len = config.model.mem_len if setting.mem_len is None else setting.mem_len
        clamp_len = config.model.attention.clamp_len if setting.clamp_len is None else setting.clamp_len
        record = {"segment_len": setting.segment_len, "mem_len": mem_len, "clamp_len": clamp_len,
                  "same_length": setting.same_length, "attn_len": setting.segment_len + mem_len,
                  "rope_scaling": setting.rope_scaling, "rope_scale": rope_scale(config, setting),
                  "metrics": module.eval_results.get(i, {})}
        reason = unsupported_reason(config, setting)
        if reason:
            record["error"] = reason
            log.warning("eval setting %d skipped: %s", i, reason)
        records.append(record)
    return {"main_metric": main_metric(config), "step": trainer.global_step, "settings": records}


def load_run(run_dir: str | Path) -> tuple[RunConfig, TransformerLM]:
    """The run's resolved config and its model with the weights of checkpoints/last.ckpt, in eval mode."""
    config = rundir.stored_config(run_dir)
    if config is None:
        raise FileNotFoundError(f"{Path(run_dir) / rundir.CONFIG} not found: not a run directory")
    checkpoint = torch.load(rundir.last_checkpoint(run_dir), map_location="cpu", weights_only=True)
    model = TransformerLM(config.model)
    prefix = "model."
    model.load_state_dict({k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)})
    return config, model.eval()
