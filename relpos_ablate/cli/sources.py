"""The results the analysis commands read (`collect`, `table`, `report`, `plot`): a results dir
collected into a frame (its problems printed as warnings), a summary.csv that `collect` wrote, or
several pooled; the runs grid specs plan; and list flags given either way (`--rows a b`, `--rows
a,b`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from relpos_ablate.cli import UsageError

MAX_PROBLEMS = 20
"""Problems of a collected results dir printed one a line; the rest are counted."""


def collected(directory: Path):
    """collect() with its problems printed as warnings; a missing dir is a one-line error."""
    from relpos_ablate.analysis.collect import collect

    if not directory.is_dir():
        raise UsageError(f"{directory}: not a directory")
    frame = collect(directory)
    problems = frame.attrs["problems"]
    for line in problems[:MAX_PROBLEMS]:
        print(f"warning: {line}", file=sys.stderr)
    if len(problems) > MAX_PROBLEMS:
        print(f"warning: ... and {len(problems) - MAX_PROBLEMS} more problems", file=sys.stderr)
    return frame


def frame_of(source: Path | list[Path]):
    """The collected frame of a results dir, or of the summary.csv `collect` wrote of one (the
    committed studies' data: their run dirs stay local); of several, their runs together."""
    from relpos_ablate.analysis.collect import merge_frames, read_summary

    if isinstance(source, list):
        frames = [frame_of(one) for one in source]
        merged = frames[0]
        for frame in frames[1:]:
            merged = merge_frames(frame, merged)
        return merged
    if source.suffix == ".csv":
        if not source.is_file():
            raise UsageError(
                f"{source}: not found; give a results dir or a summary.csv that `collect` wrote"
            )
        return read_summary(source)
    return collected(source)


def planned_only(frame, specs: list[Path]):
    """The rows of the runs the grid specs plan; the others are dropped with a one-line note."""
    from relpos_ablate.config import ConfigError
    from relpos_ablate.runner.grid import load_grid

    planned: set[str] = set()
    for spec in specs:
        try:
            planned |= {run.run_id for run in load_grid(spec).runs}
        except (OSError, ConfigError) as err:
            raise UsageError(f"--spec: {spec}: {err}") from None
    kept = frame[frame["run_id"].isin(planned)]
    dropped = sorted(set(frame["run_id"]) - planned)
    if dropped:
        print(
            f"--spec: dropped {len(dropped)} runs no spec plans ({', '.join(dropped[:5])}"
            f"{', ...' if len(dropped) > 5 else ''})",
            file=sys.stderr,
        )
    kept.attrs.update(frame.attrs)
    return kept


def keys(values: list[str] | None) -> tuple[str, ...] | None:
    """`--rows a b` and `--rows a,b` alike."""
    if values is None:
        return None
    return tuple(part for value in values for part in value.split(",") if part)
