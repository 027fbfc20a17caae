"""The run directory, `<results>/<experiment>/<run_id>/`: the one place its file names and their
meaning live (the table with who writes what: docs/architecture.md, "Run directory").

Torch-free: the grid runner, `status` and `collect` read run directories without loading the model.
Readers never raise on a damaged file: a missing, truncated or foreign file reads as None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from relpos_ablate.config import RunConfig, from_dict, read_yaml, what_to_run
from relpos_ablate.io import read_json

CONFIG = "config.yaml"
"""The resolved RunConfig (training fills in model.vocab_size)."""
RUN_INFO = "run.json"
"""Written by the runner: run id, experiment, variant (axis values as the spec wrote them), spec
path."""
STATUS = "status.json"
"""State, reason, progress and the last training-batch metrics; rewritten atomically."""
METRICS = "metrics.csv"
"""One row per logged training step."""
EVAL = "eval.json"
"""Metrics per evaluation setting: written once training is over."""
TOKEN_LOSSES = "token_losses.npz"
"""Every scored target's loss for the settings with token_losses (RECL): one float32 [streams,
targets] array per setting, named by token_losses_key(setting index), NaN where a target was not
scored."""
LOG = "log.txt"
"""The training run's human-readable log."""
WORKER_LOG = "worker.log"
"""The worker process's stdout/stderr (the runner's only record of a crash before `train` logs)."""
LOCK = ".lock"
"""fcntl.flock held while the run's worker lives (runner/store.py)."""
CHECKPOINTS = "checkpoints"
"""Lightning's checkpoint folder."""
LAST_CHECKPOINT = "last.ckpt"
"""The resume point inside CHECKPOINTS."""
TENSORBOARD = "tensorboard"
"""TensorBoard's log dir (train.loggers: [tensorboard]); W&B writes its own `wandb/` next to it."""

FINAL_STATES = ("done", "failed", "interrupted")
"""States a run ends in (written by its worker, or by the runner for a worker that died)."""
STATES = ("queued", "running", *FINAL_STATES)
"""Values of status.json `state`."""
MARKERS = (CONFIG, RUN_INFO, STATUS, EVAL, LOCK)
"""A folder holding any of these is a run directory."""
REPORT_OUTPUTS = ("figures",)
"""Folders the report commands write into a results dir: neither runs nor problems."""
KNOWN_SUFFIXES = (
    ".csv",
    ".parquet",
    ".md",
    ".tex",
    ".yaml",
    ".yml",
    ".json",
    ".png",
    ".pdf",
    ".log",
    ".txt",
    ".lock",
)
"""Files next to run dirs with these suffixes (summaries, tables, specs, locks) are expected
there."""
MAX_DEPTH = 3
"""How deep below a results dir run dirs are searched (results/<experiment>/<run_id> is 2)."""


def last_checkpoint(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS / LAST_CHECKPOINT


def token_losses_key(setting_index: int) -> str:
    """The array name of eval setting `setting_index` in TOKEN_LOSSES (eval.json records it too)."""
    return f"setting_{setting_index}"


def read_token_losses(run_dir: str | Path) -> dict | None:
    """TOKEN_LOSSES as {name: float32 array [streams, targets]}, or None when missing or
    unreadable."""
    import zipfile

    import numpy as np  # here, not at the top: the runner and `status` never read these arrays

    try:
        with np.load(Path(run_dir) / TOKEN_LOSSES) as arrays:
            return {name: arrays[name] for name in arrays.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError):
        return None


RECORD_DEFAULTS = {"max_targets": 0}
"""Values of setting fields that eval.json files written before those fields existed leave out (any
other missing field reads as None; protocol and split: record_value)."""


def record_value(record: dict, name: str, document: dict | None = None):
    """Field `name` of an eval.json setting record, as a current file would write it: a missing
    protocol is xl for same_length (files written before protocols existed), else non_overlapping; a
    missing split is the run's eval.split, which `document` (the eval.json holding the record) keeps
    in its layout (records written before settings named their split all scored it; example tasks
    have none)."""
    if name == "protocol":
        return record.get("protocol") or ("xl" if record.get("same_length") else "non_overlapping")
    if name == "split" and "split" not in record:
        layout = (document or {}).get("layout")
        return layout.get("split") if isinstance(layout, dict) else None
    return record.get(name, RECORD_DEFAULTS.get(name))


def read_status(run_dir: str | Path) -> dict | None:
    """status.json as a dict, or None when it is missing, truncated or not a status."""
    status = read_json(Path(run_dir) / STATUS)
    return status if isinstance(status, dict) and status.get("state") in STATES else None


def read_eval(run_dir: str | Path) -> dict | None:
    """eval.json as a dict, or None when it is missing or unreadable."""
    results = read_json(Path(run_dir) / EVAL)
    return results if isinstance(results, dict) else None


def read_run_info(run_dir: str | Path) -> dict | None:
    """run.json as a dict, or None (a run trained by `train` alone has none)."""
    info = read_json(Path(run_dir) / RUN_INFO)
    return info if isinstance(info, dict) else None


def is_done(run_dir: str | Path) -> bool:
    """Marked done with a readable eval.json. Done without it is resumed: fit ends at once, eval
    reruns."""
    status = read_status(run_dir)
    return status is not None and status["state"] == "done" and read_eval(run_dir) is not None


def stored_config(run_dir: str | Path) -> RunConfig | None:
    """The run's config.yaml, or None when there is none (ConfigError when it is not a valid
    config)."""
    path = Path(run_dir) / CONFIG
    return from_dict(RunConfig, read_yaml(path)) if path.exists() else None


def same_run(a: RunConfig, b: RunConfig) -> bool:
    """Equal in what they compute (how-to-run fields such as train.devices aside: HOW_TO_RUN) up to
    the vocabulary size training fills in (0 in a config means 'from the data'): a run directory
    holds one run, and only its config.yaml says which."""
    plain_a, plain_b = what_to_run(a), what_to_run(b)
    if 0 in (a.model.vocab_size, b.model.vocab_size):
        plain_a["model"]["vocab_size"] = plain_b["model"]["vocab_size"] = 0
    return plain_a == plain_b


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in MARKERS)


@dataclass
class FoundRuns:
    """Run dirs found under a results dir, and one line per foreign entry skipped there."""

    runs: list[Path] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def find_run_dirs(root: str | Path) -> FoundRuns:
    """Every run dir at or below `root` (a run dir, an experiment dir or a results dir), sorted.
    Dot and underscore entries (temp files of atomic writes, locks, .submitit) are not looked at."""
    root = Path(root)
    found = FoundRuns()
    if is_run_dir(root):
        found.runs.append(root)
    elif root.is_dir():
        _walk(root, MAX_DEPTH, found)
    return found


def _walk(folder: Path, depth: int, found: FoundRuns) -> bool:
    """Add run dirs below `folder` to `found`; True when any was found."""
    any_run = False
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith((".", "_")) or entry.name in REPORT_OUTPUTS:
            continue
        if entry.is_dir():
            if is_run_dir(entry):
                found.runs.append(entry)
                any_run = True
            elif depth > 1 and _walk(entry, depth - 1, found):
                any_run = True
            else:
                found.problems.append(
                    f"{entry}: not a run directory (no {', '.join(MARKERS)}); skipped"
                )
        elif entry.suffix not in KNOWN_SUFFIXES:
            found.problems.append(f"{entry}: foreign file; skipped")
    return any_run
