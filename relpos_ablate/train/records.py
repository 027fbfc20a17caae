"""What a run records in its directory while it trains: status.json, metrics.csv, log.txt and
checkpoints/last.ckpt, and in which order.

status.json, metrics.csv and last.ckpt are rewritten atomically (relpos_ablate.io); log.txt is an
append-only human-readable log. metrics.csv survives resumes: rows of the interrupted attempt up to
the step it resumes from are kept, later ones are replaced by the new attempt's (Lightning's
CSVLogger would delete the file instead). For that to lose no step, a checkpoint at global step G
reaches the disk only once metrics.csv holds every step below G (RunRecorder).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from relpos_ablate import rundir
from relpos_ablate.io import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    now_iso,
    read_json,
)

CONFIG_ERRORS = "config_errors"
"""status.json field of a run failed by its config (one line per problem): `train` reports them as
bad input."""
#: Fields of a previous attempt that no longer describe the run once it starts again.
STALE_FIELDS = (
    "reason",
    "traceback",
    "finished_at",
    "wall_time_s",
    "exit_code",
    "stopped",
    CONFIG_ERRORS,
)


class RunStatus:
    """status.json of one run: every update merges fields into the file and rewrites it
    atomically."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / rundir.STATUS
        previous = read_json(self.path)
        self.fields: dict[str, Any] = previous if isinstance(previous, dict) else {}
        self._t0 = time.monotonic()

    @property
    def state(self) -> str | None:
        return self.fields.get("state")

    def update(self, **fields: Any) -> None:
        self.fields.update(fields)
        atomic_write_json(self.path, self.fields)

    def start(self, device: str, max_steps: int, since: float | None = None) -> None:
        """`since`: time.monotonic() when the attempt began, if before now (the command's start-up
        counts)."""
        for key in STALE_FIELDS:
            self.fields.pop(key, None)
        self._t0 = time.monotonic() if since is None else since
        self.update(
            state="running",
            pid=os.getpid(),
            host=socket.gethostname(),
            device=device,
            started_at=now_iso(time.monotonic() - self._t0),
            max_steps=max_steps,
        )

    def finish(self, state: str, **fields: Any) -> None:
        """done | failed | interrupted, with the end time and this attempt's wall time (from
        `since`)."""
        self.update(
            state=state,
            finished_at=now_iso(),
            wall_time_s=round(time.monotonic() - self._t0, 3),
            **fields,
        )


class MetricsCSV(Logger):
    """metrics.csv with one row per logged step, merged across resumes without duplicated steps.

    Rewriting the whole file keeps it atomic; to keep that cheap on long runs it is flushed at most
    every `flush_every_s` seconds, and always before a checkpoint reaches the disk (RunRecorder) and
    at the end, so no row logged before the resume point is ever lost.
    """

    def __init__(self, run_dir: Path, flush_every_s: float = 10.0):
        super().__init__()
        self.path = Path(run_dir) / rundir.METRICS
        self.rows: dict[int, dict[str, Any]] = _read_rows(self.path)
        self.flush_every_s = flush_every_s
        self._last_flush = 0.0
        self._dirty = False

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @property
    @rank_zero_experiment
    def experiment(self) -> None:
        return None

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The resolved config is in config.yaml; nothing to add here."""

    def resume_from(self, step: int) -> None:
        """Forget rows of an interrupted attempt past `step`: the new attempt logs them again."""
        kept = {s: row for s, row in self.rows.items() if s < step}
        self._dirty |= len(kept) != len(self.rows)
        self.rows = kept

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        step = int(step if step is not None else max(self.rows, default=-1) + 1)
        row = self.rows.setdefault(step, {"step": step})
        row.update({key: _scalar(value) for key, value in metrics.items()})
        self._dirty = True

    @rank_zero_only
    def save(self) -> None:
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.flush()

    def flush(self) -> None:
        if not self._dirty:
            return
        columns = ["step"] + sorted({key for row in self.rows.values() for key in row} - {"step"})
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns)
        writer.writeheader()
        writer.writerows(self.rows[step] for step in sorted(self.rows))
        atomic_write_text(self.path, buffer.getvalue())
        self._last_flush, self._dirty = time.monotonic(), False


def _scalar(value: Any) -> float | int:
    value = value.item() if hasattr(value, "item") else value
    return value if isinstance(value, int) else float(value)


def _read_rows(path: Path) -> dict[int, dict[str, Any]]:
    """Rows of an earlier attempt, keyed by step; empty cells stay absent."""
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        rows = [
            {key: _number(value) for key, value in row.items() if value}
            for row in csv.DictReader(f)
        ]
    return {row["step"]: row for row in rows}


def _number(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        return float(text)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written like every other run file (relpos_ablate.io): a temp file next to the
    target, fsync, rename. Lightning's own writer stages the file in $TMPDIR and moves it over,
    which is a copy, not a rename, when $TMPDIR is another filesystem (node-local /tmp, results on a
    shared disk): a kill during that copy left a truncated last.ckpt, and every kill a stray temp
    file.

    While `holding`, a checkpoint is written whole to `.<name>.staged.tmp` beside its target and
    only `commit()` renames it into place (RunRecorder decides when)."""

    def __init__(self):
        super().__init__()
        self.holding = False
        self._staged: dict[Path, Path] = {}  # target -> its complete, not yet committed version

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        path = Path(path)
        if not self.holding:
            atomic_write_bytes(path, buffer.getvalue())
            return
        staged = path.with_name(f".{path.name}.staged.tmp")
        atomic_write_bytes(staged, buffer.getvalue())
        self._staged[path] = staged

    def commit(self) -> None:
        for path, staged in self._staged.items():
            os.replace(staged, path)
        self._staged.clear()

    def discard(self) -> None:
        for staged in self._staged.values():
            staged.unlink(missing_ok=True)
        self._staged.clear()


class RunRecorder(L.Callback):
    """Keeps status.json live (step and last metrics every `log_every` steps, at most once every
    `min_interval_s`, read by the grid runner's table) and metrics.csv consistent with checkpoints:
    trimmed on resume, and holding every step below a checkpoint's global step before that
    checkpoint reaches the disk, so a kill at any moment loses no step.

    Lightning saves the checkpoint of global step G (ModelCheckpoint, in on_train_batch_end) before
    it logs step G - 1 (the step that reached G) and runs its validation: during training
    checkpoints are held (AtomicCheckpointIO) and committed, right after a flush, once that step is
    recorded: at the start of the next step, at the end of training, or on an exception that came
    after the step was logged. An exception between the save and the log (the barrier that ends the
    save fails when another process died) drops the held checkpoint: the rerun resumes from the one
    before."""

    def __init__(
        self,
        status: RunStatus,
        metrics: MetricsCSV,
        checkpoints: AtomicCheckpointIO,
        log_every: int,
        min_interval_s: float = 1.0,
    ):
        self.status, self.metrics, self.checkpoints, self.log_every = (
            status,
            metrics,
            checkpoints,
            log_every,
        )
        self.min_interval_s = min_interval_s
        self._last_write = -math.inf

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # status.json has this step already (run.py, from last.ckpt)
        self.metrics.resume_from(trainer.global_step)
        self.checkpoints.holding = True

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        self._commit(keep_holding=True)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int
    ) -> None:
        step = trainer.global_step
        due = (
            step % self.log_every == 0
            and time.monotonic() - self._last_write >= self.min_interval_s
        )
        if due or step == trainer.max_steps:
            last = {
                key.removeprefix("train_"): _finite_or_none(value)
                for key, value in trainer.callback_metrics.items()
                if key.startswith("train_")
            }
            self.status.update(step=step, last_metric=last)
            self._last_write = time.monotonic()

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        self._commit(keep_holding=False)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict) -> None:
        """A checkpoint written right away (not held) comes after the log of every step it
        covers."""
        if not self.checkpoints.holding:
            self.metrics.flush()

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        if self._logged_up_to(trainer.global_step):
            self._commit(keep_holding=False)
        else:
            self.checkpoints.discard()
            self.checkpoints.holding = False
        self.status.update(step=trainer.global_step)

    def _logged_up_to(self, global_step: int) -> bool:
        """Whether step global_step - 1 has its row, or is not a step that logs one (every
        log_every-th)."""
        return global_step % self.log_every != 0 or global_step - 1 in self.metrics.rows

    def _commit(self, keep_holding: bool) -> None:
        self.metrics.flush()
        self.checkpoints.commit()
        self.checkpoints.holding = keep_holding


def _finite_or_none(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def open_log(run_dir: Path) -> logging.Handler:
    """Send this package's and Lightning's log records to log.txt (appended, one line each)."""
    handler = logging.FileHandler(Path(run_dir) / rundir.LOG, encoding="utf-8")
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    )
    for name in ("relpos_ablate", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).addHandler(handler)
    logging.getLogger("relpos_ablate").setLevel(logging.INFO)
    return handler


def close_log(handler: logging.Handler) -> None:
    for name in ("relpos_ablate", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).removeHandler(handler)
    handler.close()
