"""`relpos-ablate train`: train and evaluate one run in a run directory (argument parsing only)."""

from __future__ import annotations

import argparse
import textwrap
import time
from pathlib import Path

from relpos_ablate import rundir
from relpos_ablate.config import (
    ConfigError,
    RunConfig,
    apply_overrides,
    describe,
    from_dict,
    read_yaml,
    what_to_run,
)
from relpos_ablate.config.base import raise_all

EXIT_CODES = {"done": 0, "failed": 1, "interrupted": 1}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train and evaluate one run in a run directory",
        description=textwrap.fill(
            f"Train one run (resuming from RUN_DIR/{rundir.CHECKPOINTS}/{rundir.LAST_CHECKPOINT} "
            f"when there is one), evaluate it at every eval setting and record {rundir.CONFIG}, "
            f"{rundir.STATUS}, {rundir.METRICS}, {rundir.EVAL} and {rundir.LOG} in RUN_DIR. A run "
            f"marked done is not trained again. Exit status: 0 done, 1 failed or interrupted, 2 "
            f"bad arguments or config.",
            width=96,
        ),
        epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"run config (YAML); default: RUN_DIR/{rundir.CONFIG} when it exists",
    )
    parser.add_argument(
        "--run-dir", type=Path, required=True, metavar="DIR", help="the run directory"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override a config field, e.g. --set model.attention.terms=ac (repeatable)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads for torch, shared by the run's CPU processes (default: torch's choice)",
    )
    parser.set_defaults(func=run_train)


def config_help() -> str:
    """Every config field with its default and docstring (the field docstrings are the
    documentation)."""
    lines = ["config fields (YAML keys; --set KEY=VALUE):"]
    for path, default, doc in describe(RunConfig):
        lines.append(f"  {path} = {default}")
        lines.extend(
            textwrap.wrap(doc, width=96, initial_indent="      ", subsequent_indent="      ")
        )
    return "\n".join(lines)


def run_train(args: argparse.Namespace) -> int:
    # before torch loads: the run's wall time counts the command's start-up
    started = time.monotonic()
    from relpos_ablate.cli import UsageError, check_dir_arg

    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads: {args.threads} is not allowed; use 1 or more")
    check_dir_arg("--run-dir", args.run_dir)
    config = resolve_config(args.config, args.run_dir, args.overrides)
    if rundir.is_done(args.run_dir):
        print(f"{args.run_dir}: already done; not retraining (delete the directory to train again)")
        print_outcome(args.run_dir, "done")
        return 0

    import torch

    from relpos_ablate.train.run import launched_as_rank_zero, train_run

    if args.threads:
        torch.set_num_threads(
            max(1, args.threads // cpu_processes(config.train, torch.cuda.is_available()))
        )
    state = train_run(config, args.run_dir, started=started)
    if launched_as_rank_zero():  # the other processes of a multi-process run stay quiet
        check_config_accepted(args.run_dir, state)
        print_outcome(args.run_dir, state)
    return EXIT_CODES[state]


def check_config_accepted(run_dir: Path, state: str) -> None:
    """A run failed by its config (found once the data is there, before training) is bad input: its
    problems become the command's one-line errors (exit 2), as those found before the run
    started."""
    from relpos_ablate.train.records import CONFIG_ERRORS

    problems = (rundir.read_status(run_dir) or {}).get(CONFIG_ERRORS) if state == "failed" else None
    if problems:
        raise_all([ConfigError("", line) for line in problems])


def cpu_processes(train, cuda: bool) -> int:
    """Processes of this run that share this machine's CPU threads: train.devices when they are CPU
    processes (--threads is the whole run's budget on the node), else 1."""
    on_cpu = train.accelerator == "cpu" or (train.accelerator == "auto" and not cuda)
    return train.devices if on_cpu and isinstance(train.devices, int) else 1


def resolve_config(config_file: Path | None, run_dir: Path, overrides: list[str]) -> RunConfig:
    """The config to run: --config (+ --set), else RUN_DIR/config.yaml (+ --set). It must agree with
    an existing RUN_DIR/config.yaml: a run directory belongs to one config."""
    from relpos_ablate.cli import UsageError

    stored_path = run_dir / rundir.CONFIG
    stored = rundir.stored_config(run_dir)
    if config_file is None and stored is None:
        raise UsageError(f"--config: not given and {stored_path} does not exist")
    source = stored_path if config_file is None else config_file
    data = read_yaml(source)
    check_not_a_grid_spec(source, data)
    try:
        config = from_dict(RunConfig, apply_overrides(data, overrides))
    except ConfigError as err:
        raise_all([explain_grid_words(problem, data) for problem in err.errors])
    if stored is not None and not rundir.same_run(config, stored):
        key, old, new = first_difference(what_to_run(stored), what_to_run(config))
        raise UsageError(
            f"{stored_path} holds another run ({key}: {old!r} there, {new!r} here); "
            "use a new --run-dir"
        )
    return config


def check_not_a_grid_spec(path: Path, data: dict) -> None:
    """A grid spec passed as --config gets one line naming the command that takes it."""
    from relpos_ablate.runner.grid import is_grid_spec

    if is_grid_spec(data):
        raise ConfigError(
            str(path), f"a grid spec, not a run config; run it with: relpos-ablate grid {path}"
        )


def explain_grid_words(problem: ConfigError, data: dict) -> ConfigError:
    """`encoding` (a grid axis) given to train is unknown as a run config key; say what it would
    set."""
    if problem.field != "encoding" or not problem.message.startswith("unknown key"):
        return problem
    from relpos_ablate.runner.presets import not_a_run_key

    return ConfigError("encoding", not_a_run_key(data.get("encoding")))


def first_difference(a: dict, b: dict, prefix: str = "") -> tuple[str, object, object]:
    """(dotted key, value in a, value in b) of the first field where two plain configs differ."""
    for key in a:
        path = f"{prefix}{key}"
        if isinstance(a[key], dict) and isinstance(b.get(key), dict):
            found = first_difference(a[key], b[key], path + ".")
            if found[0]:
                return found
        elif a[key] != b.get(key) and not (key == "vocab_size" and 0 in (a[key], b.get(key))):
            return path, a[key], b.get(key)
    return "", None, None


def print_outcome(run_dir: Path, state: str) -> None:
    """The evaluation table of a finished run, or why it did not finish."""
    from rich.console import Console
    from rich.table import Table

    from relpos_ablate.analysis.settings import setting_labels

    status = rundir.read_status(run_dir) or {}
    if state != "done":
        print(f"{run_dir}: {state}: {status.get('reason', '')}")
        return
    results = rundir.read_eval(run_dir)
    names = sorted({name for s in results["settings"] for name in s["metrics"]} - {"tokens"})
    table = Table(
        title=f"{run_dir}  (step {results['step']}, main metric {results['main_metric']}, "
        f"{status.get('wall_time_s', 0):.1f} s)"
    )
    table.add_column("setting")
    for column in ("attn len", *names):
        table.add_column(column, justify="right")
    for s, setting in zip(results["settings"], setting_labels(results["settings"])):
        values = [
            f"{s['metrics'][n]:.4g}" if n in s["metrics"] else s.get("error", "-")[:40]
            for n in names
        ]
        table.add_row(setting, str(s["attn_len"]), *values)
    Console().print(table)
