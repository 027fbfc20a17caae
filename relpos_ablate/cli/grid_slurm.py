"""`grid --launcher slurm`: submit the runs not done yet as a submitit job array, and with `--wait`
follow the jobs to the end with the live table.
"""

from __future__ import annotations

import argparse

from relpos_ablate.cli.grid_slots import SLURM_FLAGS, check_runs_fit


def submit(spec, args: argparse.Namespace) -> int:
    import dataclasses

    from relpos_ablate.rundir import read_status
    from relpos_ablate.runner.slurm import submit_grid
    from relpos_ablate.runner.store import plan_grid

    overrides = {
        name: getattr(args, name) for name in SLURM_FLAGS if getattr(args, name) is not None
    }
    launcher = dataclasses.replace(spec.launcher, **overrides)
    check_runs_fit(
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
