"""What a run records in its directory while it trains: status.json, metrics.csv and log.txt.

status.json and metrics.csv are rewritten atomically (relpos_ablate.io); log.txt is an append-only
human-readable log. metrics.csv survives resumes: rows of the interrupted attempt up to the step it
resumes from are kept, later ones are replaced by the new attempt's (Lightning's CSVLogger would
delete the file instead).
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
from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from relpos_ablate import rundir
from relpos_ablate.io import atomic_write_json, atomic_write_text, now_iso, read_json

#: Fields of a previous attempt that no longer describe the run once it starts again.
STALE_FIELDS = ("reason", "traceback", "finished_at", "wall_time_s", "exit_code")


class RunStatus:
    """status.json of one run: every update merges fields into the file and rewrites it atomically."""

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

    def start(self, device: str, max_steps: int) -> None:
        for key in STALE_FIELDS:
            self.fields.pop(key, None)
        self._t0 = time.monotonic()
        self.update(state="running", pid=os.getpid(), host=socket.gethostname(), device=device,
                    started_at=now_iso(), max_steps=max_steps)

    def finish(self, state: str, **fields: Any) -> None:
        """done | failed | interrupted, with the end time and this attempt's wall time."""
        self.update(state=state, finished_at=now_iso(), wall_time_s=round(time.monotonic() - self._t0, 3), **fields)


class MetricsCSV(Logger):
    """metrics.csv with one row per logged step, merged across resumes without duplicated steps.

    Rewriting the whole file keeps it atomic; to keep that cheap on long runs it is flushed at most
    every `flush_every_s` seconds, and always before a checkpoint is written and at the end, so no
    row logged before the resume point is ever lost.
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
        rows = [{key: _number(value) for key, value in row.items() if value} for row in csv.DictReader(f)]
    return {row["step"]: row for row in rows}


def _number(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        return float(text)


class RunRecorder(L.Callback):
    """Keeps status.json live (step and last metrics every `log_every` steps, at most once every
    `min_interval_s`, read by the grid runner's table) and metrics.csv consistent with checkpoints
    (flushed before each one, trimmed on resume)."""

    def __init__(self, status: RunStatus, metrics: MetricsCSV, log_every: int, min_interval_s: float = 1.0):
        self.status, self.metrics, self.log_every = status, metrics, log_every
        self.min_interval_s = min_interval_s
        self._last_write = -math.inf

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.metrics.resume_from(trainer.global_step)
        self.status.update(step=trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        due = step % self.log_every == 0 and time.monotonic() - self._last_write >= self.min_interval_s
        if due or step == trainer.max_steps:
            last = {key.removeprefix("train_"): _finite_or_none(value)
                    for key, value in trainer.callback_metrics.items() if key.startswith("train_")}
            self.status.update(step=step, last_metric=last)
            self._last_write = time.monotonic()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict) -> None:
        self.metrics.flush()

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        self.status.update(step=trainer.global_step)


def _finite_or_none(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def open_log(run_dir: Path) -> logging.Handler:
    """Send this package's and Lightning's log records to log.txt (appended, one line each)."""
    handler = logging.FileHandler(Path(run_dir) / rundir.LOG, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    for name in ("relpos_ablate", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).addHandler(handler)
    logging.getLogger("relpos_ablate").setLevel(logging.INFO)
    return handler


def close_log(handler: logging.Handler) -> None:
    for name in ("relpos_ablate", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).removeHandler(handler)
    handler.close()
