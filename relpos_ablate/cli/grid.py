"""`relpos-ablate grid SPEC` (run a sweep locally or on SLURM) and `relpos-ablate status DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from relpos_ablate.cli import UsageError, check_dir_arg

SLURM_FLAGS = ("partition", "time", "gpus", "nodes", "account", "array_parallelism")


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

    _check_flags(args)
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
        return _submit(spec, args)
    return _run_local(spec, args)


def _check_flags(args: argparse.Namespace) -> None:
    """Contradictory or out-of-range flags are one-line usage errors, never silently ignored."""
    if args.devices is not None and args.slots is not None:
        raise UsageError("--devices (GPUs) and --slots (CPU) exclude each other; give one")
    if args.slots is not None and args.slots < 1:
        raise UsageError(f"--slots: {args.slots} is out of range; allowed >= 1")
    if args.runs_per_device is not None and args.runs_per_device < 1:
        raise UsageError(f"--runs-per-device: {args.runs_per_device} is out of range; allowed >= 1")
    if args.runs_per_device is not None and args.slots is not None:
        raise UsageError(
            "--runs-per-device applies to GPUs; with --slots give the number of CPU slots only"
        )
    if args.gpus_per_run is not None and args.gpus_per_run < 1:
        raise UsageError(f"--gpus-per-run: {args.gpus_per_run} is out of range; allowed >= 1")
    if args.gpus_per_run is not None and args.slots is not None:
        raise UsageError("--gpus-per-run groups GPUs; CPU slots (--slots) train one process each")
    given = [
        f"--{name.replace('_', '-')}" for name in SLURM_FLAGS if getattr(args, name) is not None
    ]
    given += ["--wait"] if args.wait else []
    if args.launcher == "local" and given:
        raise UsageError(
            f"{', '.join(given)}: only with --launcher slurm"
            + (" (a local grid always waits)" if args.wait else "")
        )
    if args.launcher == "slurm" and (
        args.devices or args.slots or args.runs_per_device or args.gpus_per_run
    ):
        raise UsageError(
            "--devices/--slots/--runs-per-device/--gpus-per-run are for --launcher local; SLURM "
            "jobs use --gpus (per node) and --nodes"
        )
    if args.devices is not None:
        _group_devices(_parse_devices(args.devices), args.gpus_per_run or 1)
    check_dir_arg("--results", args.results)


def _parse_devices(text: str) -> list[int]:
    try:
        devices = [int(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(f"--devices: {text!r}: give GPU numbers like 0,1,2,3") from None
    if len(set(devices)) != len(devices):
        raise UsageError(
            f"--devices: {text!r} lists a GPU twice; use --runs-per-device for several runs per GPU"
        )
    return devices


def _group_devices(devices: list[int], gpus_per_run: int) -> list[int]:
    if len(devices) % gpus_per_run:
        raise UsageError(
            f"--gpus-per-run: {len(devices)} GPU(s) do not form groups of {gpus_per_run}; "
            f"give a multiple of {gpus_per_run} in --devices"
        )
    return devices


def _visible(devices: list[int], visible: int) -> list[int]:
    bad = [d for d in devices if not 0 <= d < visible]
    if bad:
        raise UsageError(
            f"--devices: GPU {bad[0]} is not visible; allowed 0..{visible - 1}"
            if visible
            else "--devices: no CUDA GPU is visible; use --slots N for CPU slots"
        )
    return devices


def slots_for(args: argparse.Namespace) -> list:
    """The slots the flags ask for. Counting GPUs imports torch (seconds), so call it only when a
    run is to be launched: the rerun of a finished grid stays torch-free."""
    from relpos_ablate.runner.local import cpu_slots, gpu_slots
    from relpos_ablate.runner.worker import available_cores

    if args.slots is not None:
        return cpu_slots(args.slots)
    import torch

    visible = torch.cuda.device_count()
    group = args.gpus_per_run or 1
    if args.devices is not None:
        devices = _visible(_parse_devices(args.devices), visible)
    elif visible:
        # whole groups of the visible GPUs
        devices = _group_devices(list(range(visible // group * group)), group)
    else:
        if args.runs_per_device is not None or args.gpus_per_run is not None:
            flag = "--runs-per-device" if args.runs_per_device is not None else "--gpus-per-run"
            raise UsageError(f"{flag}: no CUDA GPU is visible; use --slots N for CPU slots")
        return cpu_slots(max(1, available_cores() // 2))
    if not devices:
        raise UsageError(f"--gpus-per-run: {group} is more than the {visible} visible GPU(s)")
    return gpu_slots(devices, args.runs_per_device or 1, gpus_per_run=group)


def _check_runs_fit(plans, processes: int, flag: str) -> None:
    """Every run to launch can split its streams over `processes` (one line naming the first that
    cannot)."""
    from relpos_ablate.config import ConfigError, check_world_size
    from relpos_ablate.runner.display import short_variant

    for plan in plans:
        try:
            check_world_size(plan.run.config, processes)
        except ConfigError as err:
            raise UsageError(
                f"{flag}: run {plan.run.run_id} [{short_variant(plan.run.variant)}] cannot be "
                f"split over {processes} processes: {err}"
            ) from None


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
    _check_runs_fit(
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


def _submit(spec, args: argparse.Namespace) -> int:
    import dataclasses

    from relpos_ablate.rundir import read_status
    from relpos_ablate.runner.slurm import submit_grid
    from relpos_ablate.runner.store import plan_grid

    overrides = {
        name: getattr(args, name) for name in SLURM_FLAGS if getattr(args, name) is not None
    }
    launcher = dataclasses.replace(spec.launcher, **overrides)
    _check_runs_fit(
        [p for p in plan_grid(spec, args.results, args.retry_failed) if p.action != "skip"],
        max(1, launcher.gpus) * launcher.nodes,
        "--gpus/--nodes",
    )
    submitted = submit_grid(spec, args.results, launcher, retry_failed=args.retry_failed)
    if not submitted:
        plans = plan_grid(spec, args.results, args.retry_failed)
        open_runs = [p for p in plans if (read_status(p.run_dir) or {}).get("state") != "done"]
        print(
            f"grid {spec.name}: nothing to submit; "
            + (
                f"{len(open_runs)} run(s) failed or running elsewhere, see relpos-ablate status "
                f"{args.results / spec.name}"
                if open_runs
                else "every run is done"
            )
        )
        return 1 if open_runs else 0
    job_ids = sorted({str(job.job_id).split("_")[0] for _plan, job in submitted})
    print(
        f"grid {spec.name}: submitted {len(submitted)} run(s) as SLURM job {', '.join(job_ids)}; "
        + (
            "following them to the end"
            if args.wait
            else f"follow with: relpos-ablate status {args.results / spec.name}"
        )
    )
    return _wait_for_jobs(spec, submitted) if args.wait else 0


def _wait_for_jobs(spec, submitted) -> int:
    """The live table of the submitted runs until every job has ended; 0 when all are done,
    else 1."""
    from relpos_ablate.rundir import read_status
    from relpos_ablate.runner.display import make_console, make_display, row_for, run_table
    from relpos_ablate.runner.slurm import follow

    console = make_console()
    display = make_display(console)

    def table():
        rows = [
            row_for(plan.run_dir, plan.run.variant, probe_lock=True) for plan, _job in submitted
        ]
        return run_table(rows, title=f"grid {spec.name}", live=display.live)

    with display:
        follow(submitted, lambda: display.refresh(table()))
    if not display.live:
        console.print(table())
    states = [(read_status(plan.run_dir) or {}).get("state") for plan, _job in submitted]
    print(
        f"grid {spec.name}: "
        + ", ".join(f"{states.count(s)} {s}" for s in sorted(set(map(str, states))))
    )
    return 0 if all(state == "done" for state in states) else 1


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
