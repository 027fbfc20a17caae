"""Loading the trained runs a figure of a model draws (`plot --kind bias | attention | terms`), and
why a run cannot be drawn: a module its config imports is missing, no or a corrupt checkpoint, no
bias."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from relpos_ablate.analysis import figures
from relpos_ablate.config import ConfigError
from relpos_ablate.config.base import raise_all
from relpos_ablate.config.registry import import_modules

UNLOADABLE = (
    ConfigError,
    OSError,
    ValueError,
    RuntimeError,
    EOFError,
    KeyError,
    pickle.UnpicklingError,
)
"""What loading a trained run can raise (no or a corrupt checkpoint, a config the code rejects):
that run is skipped in a grid, and a one-line error for a single run."""


def check_imports(runs: pd.DataFrame) -> None:
    """When no run can be loaded because a module its config lists under `imports:` cannot be
    imported here, one line per such module: the runs that need it and how to make it importable.
    (When some runs can be drawn, the others are left out one by one, each note naming its
    module.)"""
    needs: dict[str, list[str]] = {}
    for _, run in runs.iterrows():
        for module in _imports(run):
            needs.setdefault(module, []).append(str(run["run_id"]))
    failed = {}
    for module in needs:
        try:
            import_modules([module])
        except ConfigError as err:
            cause = err.__cause__
            failed[module] = (
                f"{type(cause).__name__}: {' '.join(str(cause).split())}" if cause else err.message
            )
    if not failed or len({rid for module in failed for rid in needs[module]}) < len(runs):
        return
    raise_all(
        [
            ConfigError(
                "imports",
                f"cannot import {module!r} ({why}), listed under imports: by "
                f"run{'s' if len(needs[module]) > 1 else ''} {', '.join(needs[module])}; run plot "
                f"from the folder that holds {module.split('.')[0]} (where the runs were "
                f"trained), or add that folder to PYTHONPATH",
            )
            for module, why in failed.items()
        ]
    )


def _imports(run: pd.Series) -> list[str]:
    """The modules a collected run's config lists under `imports:` (collect keeps lists as JSON
    text)."""
    try:
        modules = json.loads(run.get("imports") or "[]")
    except (TypeError, json.JSONDecodeError):
        return []
    return [m for m in modules if isinstance(m, str)] if isinstance(modules, list) else []


def load_drawable(run_dir: Path, kind: str, loader: Callable):
    """(config, model) of a run that can be drawn as `kind`, else a one-line ConfigError naming the
    run."""
    try:
        config, model = loader(run_dir)
    except UNLOADABLE as err:
        first_sentence = str(err).split(". ")[0]
        raise ConfigError(
            str(run_dir), f"cannot load the trained model: {first_sentence}"
        ) from None
    if kind == "bias":
        try:
            figures.check_has_bias(model, "this run")
        except ConfigError as err:
            raise ConfigError(str(run_dir), err.message) from None
    return config, model
