"""`relpos-ablate evaluate DIR`: new evaluation settings on trained runs, from their checkpoints,
without retraining (train/evaluate_run.py; several runs at once on slots: runner/evaluate.py)."""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

from relpos_ablate import rundir
from relpos_ablate.cli import UsageError

EXAMPLE = (
    "relpos-ablate evaluate results/alibi_extrapolation_cpu "
    "--set 'eval.settings=[{segment_len: 64, protocol: sliding, stride: 1}, "
    "{segment_len: 64, protocol: sliding, stride: 8}]'"
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "evaluate",
        help="evaluate trained runs at new evaluation settings, from their trained weights (no "
        "retraining)",
        description=textwrap.fill(
            f"Load each done run's trained weights "
            f"({rundir.CHECKPOINTS}/{rundir.LAST_CHECKPOINT}) and evaluate the settings the --set "
            f"overrides give (eval.* fields: lengths, protocols, strides, RoPE scaling, RECL "
            f"contexts, diagnostics). The records join the run's {rundir.EVAL}; settings already "
            f"there are kept, and one already evaluated with the same fields is skipped unless "
            f"--replace. The run id, {rundir.CONFIG}, {rundir.CHECKPOINTS}, {rundir.METRICS} and "
            f"{rundir.STATUS} do not change, so a rerun of the run's grid still sees it done. "
            f"Every problem is reported before anything is computed. Exit status: 0 every run "
            f"evaluated, 1 some failed, 2 bad arguments or settings, 130 stopped.",
            width=96,
        )
        + f"\n\nexample (ALiBi App. B):\n  {EXAMPLE}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "dir",
        type=Path,
        metavar="DIR",
        help="one run dir, an experiment or a results dir: every done run under it",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="an evaluation field, e.g. --set 'eval.settings=[{segment_len: 256}]' or --set "
        "eval.diagnostics=true (eval.* keys; example tasks also data.test_lengths, "
        "data.eval_examples, data.passkey_depths); repeatable",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help=f"evaluate settings already in {rundir.EVAL} again, replacing their records",
    )
    p.add_argument(
        "--slots",
        type=int,
        metavar="N",
        help="evaluate N runs at a time on CPU slots (threads split between them)",
    )
    p.add_argument(
        "--devices",
        metavar="LIST",
        help="evaluate one run at a time on each of these GPUs, e.g. 0,1",
    )
    p.add_argument(
        "--threads", type=int, metavar="N", help="CPU threads for torch (default: torch's choice)"
    )
    # a worker of --slots: its runs were planned with the others (_plans), and their lines printed
    p.add_argument("--planned", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_evaluate, runs_per_device=None, gpus_per_run=None)


def cmd_evaluate(args: argparse.Namespace) -> int:
    if args.devices is not None and args.slots is not None:
        raise UsageError("--devices (GPUs) and --slots (CPU) exclude each other; give one")
    for flag in ("slots", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag}: {value} is out of range; allowed >= 1")
    runs = _runs(args.dir)

    import torch

    from relpos_ablate.config.base import ConfigErrors

    if args.threads:
        torch.set_num_threads(args.threads)
    plans, errors = _plans(runs, args)
    if errors:
        raise ConfigErrors(errors)
    for plan in plans if not args.planned else ():
        for name, reason in plan.unsupported:
            print(f"{plan.run_dir}: {name}: not evaluated, recorded with its reason: {reason}")
    todo = [plan for plan in plans if plan.todo]
    if not todo:
        print(
            f"{args.dir}: nothing to evaluate: every setting is already in {rundir.EVAL} "
            f"(--replace evaluates again)"
        )
        return 0
    if len(todo) > 1 and (args.devices is not None or (args.slots or 1) > 1):
        return _on_slots(todo, args)
    return _in_process(todo)


def _plans(runs: list[Path], args: argparse.Namespace):
    """The runs' plans and every problem found. A worker of --slots (--planned) plans its one run
    without asking whether any run can take each setting: the parent asked that of every run
    together, so a setting only some runs cannot take is recorded in theirs with its reason, as
    without --slots (planned alone, the run would be the only one and fail)."""
    from relpos_ablate.config.base import ConfigError
    from relpos_ablate.train.evaluate_run import plan_all, plan_evaluation

    if not args.planned:
        return plan_all(runs, args.overrides, args.replace)
    plans, errors = [], []
    for run in runs:
        try:
            plans.append(plan_evaluation(run, args.overrides, args.replace))
        except ConfigError as err:
            errors.extend(err.errors)
    return plans, errors


def _runs(directory: Path) -> list[Path]:
    """DIR itself when it is a run dir, else every done run under it (the others are named and left
    out)."""
    if rundir.is_run_dir(directory):
        return [directory]
    found = rundir.find_run_dirs(directory).runs
    if not found:
        raise UsageError(
            f"{directory}: no run directories found (expected a run dir, results/<experiment> "
            f"or results/)"
        )
    done = [run for run in found if rundir.is_done(run)]
    for run in found:
        if run not in done:
            state = (rundir.read_status(run) or {}).get("state", "unknown")
            print(f"{run}: left out: not done (state {state})")
    if not done:
        raise UsageError(
            f"{directory}: none of its {len(found)} runs is done; evaluate takes finished runs"
        )
    return done


def _in_process(plans) -> int:
    from relpos_ablate.runner.store import RunLock
    from relpos_ablate.train.evaluate_run import run_evaluation

    worst = 0
    for plan in plans:
        lock = RunLock(plan.run_dir)
        if not lock.try_acquire():
            print(
                f"{plan.run_dir}: busy: another process holds {rundir.LOCK} (a grid or another "
                f"evaluate); rerun when it ends",
                file=sys.stderr,
            )
            worst = 1
            continue
        started = time.monotonic()
        try:
            count = run_evaluation(plan)
        except KeyboardInterrupt:
            print(
                f"{plan.run_dir}: interrupted by the user; its {rundir.EVAL} is as it was: rerun "
                f"the same command to finish",
                file=sys.stderr,
            )
            return 130
        except Exception as err:  # one run's failure does not stop the others
            print(
                f"{plan.run_dir}: failed: {type(err).__name__}: {' '.join(str(err).split())}",
                file=sys.stderr,
            )
            worst = 1
            continue
        finally:
            lock.release()
        print(
            f"{plan.run_dir}: evaluated {count} setting(s), {plan.skipped} already in "
            f"{rundir.EVAL} ({time.monotonic() - started:.1f} s)"
        )
    return worst


def _on_slots(plans, args: argparse.Namespace) -> int:
    from relpos_ablate.cli.grid_slots import slots_for
    from relpos_ablate.runner.evaluate import evaluate_on_slots

    slots = slots_for(args)
    arguments = [
        *(a for item in args.overrides for a in ("--set", item)),
        *(["--replace"] if args.replace else []),
        "--planned",  # planned here with the other runs (_plans)
    ]
    try:
        return evaluate_on_slots([plan.run_dir for plan in plans], arguments, slots)
    except KeyboardInterrupt:
        print(
            f"interrupted by the user; each run's {rundir.EVAL} is as it was or complete: rerun "
            f"the same command to finish",
            file=sys.stderr,
        )
        return 130
