"""`relpos-ablate grid SPEC` (run a sweep locally or on SLURM) and `relpos-ablate status DIR`.

The flags turned into slots: cli/grid_slots.py; the SLURM submission: cli/grid_slurm.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from relpos_ablate.cli import UsageError
from relpos_ablate.cli.grid_slots import check_flags, check_runs_fit, slots_for
from relpos_ablate.cli.grid_slurm import submit


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "grid",
        help="run every run of a grid spec that is not done yet (local slots or SLURM)",
        description="Idempotent: done runs are skipped, interrupted ones resume from their last "
        "checkpoint, failed ones are skipped unless --retry-failed. Exit status: 0 all done, 1 "
        "some failed or incomplete, 2 a bad spec or flag, 130 stopped.",
    )
    p.add_argument(
        "spec",
        type=Path,
        metavar="SPEC",
        help="grid spec YAML (format: relpos_ablate/runner/grid.py, examples: experiments/)",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=Path("results"),
        metavar="DIR",
        help="results root; runs go to DIR/<name>/<run_id>/ (default: results)",
    )
    p.add_argument(
        "--devices",
        metavar="LIST",
        help="GPUs to use, e.g. 0,1,2,3 (default: every visible GPU, else CPU slots)",
    )
    p.add_argument(
        "--slots",
        type=int,
        metavar="N",
        help="run on N CPU slots, torch threads split between them "
        "(default without GPUs: one slot per 2 cores)",
    )
    p.add_argument(
        "--runs-per-device",
        type=int,
        metavar="K",
        help="concurrent runs per GPU (group) (default 1)",
    )
    p.add_argument(
        "--gpus-per-run",
        type=int,
        metavar="K",
        help="train each run data-parallel on a group of K of "
        "the --devices GPUs (sets train.devices; default 1)",
    )
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="run failed runs again (from their last checkpoint; delete a run's dir to start it "
        "over)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    p.add_argument(
        "--fresh-workers",
        action="store_true",
        help="start every worker as a new interpreter (default: a worker on a CPU slot is forked "
        "from a server that imported torch and Lightning once; relpos_ablate/runner/forkserver.py)",
    )
    p.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local: processes on this machine; slurm: a submitit job array",
    )
    p.add_argument(
        "--partition",
        metavar="NAME",
        help="slurm: partition (overrides the spec's launcher: block)",
    )
    p.add_argument(
        "--time",
        type=int,
        metavar="MIN",
        help="slurm: minutes per job; longer runs are requeued and resume",
    )
    p.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="slurm: GPUs per node of a job, one run data-parallel over them (one task per GPU)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="slurm: nodes per job (one run spans nodes x gpus GPUs)",
    )
    p.add_argument("--account", metavar="NAME", help="slurm: account to charge")
    p.add_argument(
        "--array-parallelism",
        type=int,
        metavar="N",
        help="slurm: jobs of the array running at once",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="slurm: follow the jobs to the end with the live table "
        "(exit status as for a local grid)",
    )
    p.set_defaults(func=cmd_grid)

    p = subparsers.add_parser(
        "status",
        help="the runs of a results dir: state, progress, last training-batch metrics",
        description="Reads only; a run marked running whose process is gone shows as stale.",
    )
    p.add_argument(
        "dir",
        type=Path,
        metavar="DIR",
        help="results/<experiment> (or results/ for every experiment)",
    )
    p.set_defaults(func=cmd_status)


def cmd_grid(args: argparse.Namespace) -> int:
    from relpos_ablate.runner.grid import GridSpecError, load_grid

    check_flags(args)
    try:
        spec = load_grid(args.spec)
    except GridSpecError as err:
        print(
            f"error: {args.spec}: {len(err.errors)} problem(s) in the grid spec, nothing launched",
            file=sys.stderr,
        )
        for problem in err.errors:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(spec, args)
    if args.launcher == "slurm":
        return submit(spec, args)
    return _run_local(spec, args)


def _dry_run(spec, args: argparse.Namespace) -> int:
    from rich.table import Table

    from relpos_ablate.runner.display import format_elapsed, make_console, short_variant
    from relpos_ablate.runner.estimate import estimate
    from relpos_ablate.runner.store import ACTIONS, RUNNABLE, plan_grid

    plans = plan_grid(spec, args.results, args.retry_failed)
    table = Table(title=f"grid {spec.name}: dry run ({args.results / spec.name})")
    for column in ("run", "variant", "action", "note"):
        table.add_column(column)
    for plan in plans:
        table.add_row(plan.run.run_id, short_variant(plan.run.variant), plan.action, plan.note)
    console = make_console()
    console.print(table)
    counts = {action: sum(p.action == action for p in plans) for action in ACTIONS}
    console.print(
        ", ".join(f"{n} {action}" for action, n in counts.items() if n) + f" ({len(plans)} runs)"
    )
    n_slots = len(slots_for(args)) if any(p.action in RUNNABLE for p in plans) else 1
    guess = estimate(plans, args.results, spec.name, n_slots)
    if guess is None:
        console.print(
            f"no wall-time estimate: no run of this spec has finished and "
            f"{args.results / spec.name}/train_step.json is missing (python "
            f"benchmarks/train_step.py --spec {spec.path or spec.name})",
            highlight=False,
        )
    elif guess.runs:
        console.print(
            f"estimated wall time of the {guess.runs} run(s) to go on {n_slots} slot(s): "
            f"{format_elapsed(guess.seconds)} (from {guess.source})",
            highlight=False,
        )
    return 0


def _run_local(spec, args: argparse.Namespace) -> int:
    from relpos_ablate.runner.display import make_console, make_display, run_table
    from relpos_ablate.runner.local import LocalRunner
    from relpos_ablate.runner.store import plan_grid

    pending = [
        plan for plan in plan_grid(spec, args.results, args.retry_failed) if plan.action != "skip"
    ]
    slots = slots_for(args) if pending else []
    check_runs_fit(
        pending,
        max((len(slot.gpu.split(",")) for slot in slots if slot.gpu), default=1),
        "--gpus-per-run",
    )
    console = make_console()
    display = make_display(console)
    runner = LocalRunner(
        spec,
        args.results,
        slots,
        display,
        retry_failed=args.retry_failed,
        fork=not args.fresh_workers,
    )
    outcome = runner.run()
    if not display.live:
        console.print(run_table(runner.rows(), title=f"grid {spec.name}"))
    _print_summary(console, spec, outcome, runner.plans, args.retry_failed)
    return outcome.exit_code()


def _print_summary(console, spec, outcome, plans, retry_failed: bool) -> None:
    from relpos_ablate.runner.display import short_variant

    counts: dict[str, int] = {}
    for state in outcome.states.values():
        counts[state] = counts.get(state, 0) + 1
    states = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    slots = (
        f" on {outcome.n_slots} slot(s), slots busy {outcome.utilisation:.0%}"
        if outcome.launched
        else ""
    )
    console.print(
        f"grid {spec.name}: {states}; ran {outcome.launched} in {outcome.wall_s:.1f}s{slots}",
        highlight=False,
    )
    variants = {plan.run.run_id: short_variant(plan.run.variant) for plan in plans}
    for rid in outcome.failed + outcome.incomplete:
        console.print(
            f"  {outcome.states[rid]}: {rid} [{variants[rid]}] {outcome.reasons[rid]}",
            markup=False,
            highlight=False,
        )
    if outcome.failed and not retry_failed:
        console.print("  failed runs are skipped on a rerun unless --retry-failed", highlight=False)
    if outcome.stopped:
        console.print(
            f"stopped by {outcome.stopped}; rerun the same command to resume", highlight=False
        )


def cmd_status(args: argparse.Namespace) -> int:
    from relpos_ablate.rundir import find_run_dirs
    from relpos_ablate.runner.display import make_console, row_for, run_table, state_counts

    run_dirs = find_run_dirs(args.dir).runs
    if not run_dirs:
        raise UsageError(
            f"{args.dir}: no run directories found (expected results/<experiment>/<run_id>/)"
        )
    console = make_console()
    experiments: dict[Path, list] = {}
    for run_dir in run_dirs:
        experiments.setdefault(run_dir.parent, []).append(row_for(run_dir, probe_lock=True))
    for experiment, rows in experiments.items():
        rows.sort(key=lambda row: (row.variant, row.run_id))
        console.print(run_table(rows, title=str(experiment), live=console.is_terminal))
        console.print(f"{experiment.name}: {state_counts(rows)}", highlight=False)
    return 0
