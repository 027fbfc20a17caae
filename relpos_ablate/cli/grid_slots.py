"""`grid`'s flags (and `evaluate --slots/--devices`') checked and turned into slots: contradictory
or out-of-range flags are one-line usage errors, GPUs are grouped for data-parallel runs, and every
run to launch must split over its slot's processes.
"""

from __future__ import annotations

import argparse

from relpos_ablate.cli import UsageError, check_dir_arg

SLURM_FLAGS = ("partition", "time", "gpus", "nodes", "account", "array_parallelism")
"""The flags of `grid --launcher slurm` that override the spec's launcher: block."""


def check_flags(args: argparse.Namespace) -> None:
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


def check_runs_fit(plans, processes: int, flag: str) -> None:
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
