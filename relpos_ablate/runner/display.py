"""What the runner shows: one row per run (variant, state, device, progress, the metrics of the last
training batch, elapsed).

`row_for` reads a run directory and never fails on a broken one (a truncated status.json shows as
`unreadable`); `run_table` renders rows with rich. `LiveDisplay` redraws the table in place on a
terminal; `PlainDisplay` prints one line per event, for logs and pipes.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from relpos_ablate import rundir
from relpos_ablate.config.schedule import shown_value
from relpos_ablate.runner.store import DONE_WITHOUT_EVAL, lock_holder

STATE_STYLES = {
    "queued": "dim",
    "running": "cyan",
    "done": "green",
    "failed": "bold red",
    "interrupted": "yellow",
    "stale": "yellow",
    "unreadable": "red",
    "new": "dim",
    "incomplete": "yellow",
}


@dataclass
class RunRow:
    """One run as displayed; `metric` is what the last training batch logged (status.json
    `last_metric`)."""

    run_id: str
    variant: str
    state: str
    device: str = ""
    step: int | None = None
    max_steps: int | None = None
    metric: str = ""
    elapsed_s: float | None = None
    note: str = ""


def parse_time(value: Any) -> float | None:
    """Seconds since the epoch from an epoch number or an ISO-8601 string; None when neither."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            stamp = datetime.datetime.fromisoformat(value)
        except ValueError:
            return None
        if stamp.tzinfo is None:
            stamp = stamp.astimezone()
        return stamp.timestamp()
    return None


def short_variant(variant: Any) -> str:
    """`model.attention.terms=ac seed=0` -> `terms=ac seed=0` (full key paths only where
    ambiguous)."""
    if not isinstance(variant, dict):
        return "?"
    leaves = [str(key).rsplit(".", 1)[-1] for key in variant]
    names = [leaf if leaves.count(leaf) == 1 else str(key) for leaf, key in zip(leaves, variant)]
    return (
        " ".join(f"{name}={shown_value(value)}" for name, value in zip(names, variant.values()))
        or "(base)"
    )


def format_metric(last_metric: Any, limit: int = 2) -> str:
    if not isinstance(last_metric, dict):
        return ""
    items = [
        (k, v)
        for k, v in last_metric.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    return " ".join(f"{k} {v:.4g}" for k, v in items[:limit])


def format_elapsed(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _elapsed(status: dict, now: float) -> float | None:
    """Wall time of a finished run, or time since start of a running one."""
    if isinstance(status.get("wall_time_s"), (int, float)) and status["state"] != "running":
        return float(status["wall_time_s"])
    started = parse_time(status.get("started_at"))
    if started is None:
        return None
    if status["state"] == "running":
        return now - started
    finished = parse_time(status.get("finished_at"))
    return None if finished is None else finished - started


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def row_for(run_dir: Path, variant: Any = None, probe_lock: bool = False) -> RunRow:
    """A run's row from its files; `probe_lock` tells a `running` run whose process is gone
    (stale)."""
    if variant is None:
        variant = (rundir.read_run_info(run_dir) or {}).get("variant")
    status = rundir.read_status(run_dir)
    row = RunRow(run_id=run_dir.name, variant=short_variant(variant), state="new")
    if status is None:
        if (run_dir / rundir.STATUS).exists():
            row.state, row.note = "unreadable", f"{rundir.STATUS} is truncated or not a status"
        return row
    row.state = status["state"]
    row.device = str(status.get("device") or "")
    row.step, row.max_steps = _int(status.get("step")), _int(status.get("max_steps"))
    row.metric = format_metric(status.get("last_metric"))
    row.elapsed_s = _elapsed(status, time.time())
    row.note = str(status.get("reason") or "")
    if row.state == "done" and not rundir.is_done(run_dir):
        row.state, row.note = "incomplete", DONE_WITHOUT_EVAL
    if probe_lock and row.state == "running" and lock_holder(run_dir) is None:
        row.state, row.note = (
            "stale",
            "marked running but no process holds it; rerun the grid to resume",
        )
    return row


def _progress(row: RunRow, live: bool, bar_width: int) -> Any:
    if row.step is None:
        return ""
    if row.max_steps is None:
        return str(row.step)
    label = f"{row.step}/{row.max_steps}"
    if not live or bar_width == 0:
        return label
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=row.max_steps, completed=row.step, width=bar_width), label)
    return bar


WIDE = 140
"""Columns from which the table gives every field its own column and a 12-character progress bar;
narrower, the device goes under the state and the note under the variant, and below 100 columns
the bar goes, so that run ids, states and progress stay whole from 80 columns up."""


class RunTable:
    """The runs' table, laid out for the width it is drawn at (a rich renderable)."""

    def __init__(self, rows: list[RunRow], title: str = "", live: bool = False):
        self.rows, self.title, self.live = rows, title, live

    def __rich_console__(self, console: Console, options: Any):
        yield self.table(options.max_width)

    def table(self, width: int) -> Table:
        wide = width >= WIDE
        bar_width = 12 if wide else 6 if width >= 100 else 0
        table = Table(title=self.title or None, show_lines=False, expand=False)
        # whole: what identifies a run and where it stands; wrapped: the free text
        table.add_column(
            "run", no_wrap=True, min_width=max((len(r.run_id) for r in self.rows), default=3)
        )
        table.add_column("variant", overflow="fold", ratio=2)
        table.add_column("state", no_wrap=True)
        if wide:
            table.add_column("device", no_wrap=True)
        table.add_column("progress", no_wrap=True)
        table.add_column("last train batch", overflow="fold", ratio=1)
        table.add_column("elapsed", no_wrap=True)
        if wide:
            table.add_column("note", overflow="fold")
        for row in self.rows:
            state = Text(row.state, style=STATE_STYLES.get(row.state, ""))
            variant = Text(row.variant)
            if not wide and row.device:
                state.append(f"\n{row.device}", style="dim")
            if not wide and row.note:
                variant.append(f"\n{row.note}", style="dim")
            table.add_row(
                row.run_id,
                variant,
                state,
                *([row.device] if wide else []),
                _progress(row, self.live, bar_width),
                row.metric,
                format_elapsed(row.elapsed_s),
                *([row.note] if wide else []),
            )
        return table


def run_table(rows: list[RunRow], title: str = "", live: bool = False) -> RunTable:
    """The runs' table: one row per run, its columns chosen by the width it is drawn at."""
    return RunTable(rows, title, live)


def state_counts(rows: list[RunRow]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.state] = counts.get(row.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


class PlainDisplay:
    """One timestamped line per event; the table only at the end (logs, pipes, CI)."""

    live = False

    def __init__(self, console: Console):
        self.console = console

    def __enter__(self) -> PlainDisplay:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def event(self, row: RunRow, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.console.print(
            f"{stamp} {row.run_id} [{row.variant}] {text}", markup=False, highlight=False
        )

    def refresh(self, table: Table) -> None:
        return None


class LiveDisplay(PlainDisplay):
    """The table redrawn in place (refreshed by the runner's loop: no thread, so workers can be
    spawned safely); events are printed above it."""

    live = True

    def __init__(self, console: Console):
        super().__init__(console)
        self._live = Live(
            console=console, auto_refresh=False, transient=False, redirect_stdout=False
        )

    def __enter__(self) -> LiveDisplay:
        self._live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._live.stop()

    def refresh(self, table: Table) -> None:
        self._live.update(table, refresh=True)


def make_console() -> Console:
    """A terminal console, or a wide one for logs and pipes (rich would wrap tables at 80
    columns)."""
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 200))


def make_display(console: Console) -> PlainDisplay:
    return LiveDisplay(console) if console.is_terminal else PlainDisplay(console)
