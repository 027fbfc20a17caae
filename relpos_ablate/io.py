"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml


def now_iso(ago_s: float = 0.0) -> str:
    """The current UTC time (or `ago_s` seconds before it) as ISO 8601 to the second: the timestamps
    in status.json."""
    stamp = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=ago_s)
    return stamp.isoformat(timespec="seconds")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; results are shared on clusters
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def atomic_write_yaml(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, yaml.safe_dump(obj, sort_keys=False))


def read_json(path: str | Path) -> Any:
    """Parsed JSON, or None when the file is missing (also: a folder, or under a file) or not valid
    JSON (e.g. truncated)."""
    try:
        return json.loads(Path(path).read_text())
    except (
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
        json.JSONDecodeError,
        UnicodeDecodeError,
    ):
        return None
