"""Data-parallel throughput: one run on 2 CPU processes (Lightning DDP, gloo) relative to 1 process,
same global batch, the real `train_run`. Every process gets the same number of torch threads, so 2
processes use twice the cores: the ideal ratio is 2, less what the per-step gradient all-reduce and
the shared machine take. For the record, not a goal (this project's machine has 2 cores).

    python benchmarks/ddp.py                       # 1 thread per process
    python benchmarks/ddp.py --threads 2 --set model.d_model=256

Each measurement is a fresh `python benchmarks/ddp.py --processes P --run-dir DIR` (Lightning starts
the other process by running the same command); timing covers steps warmup..warmup+steps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

from relpos_ablate.config import load_run_config
from relpos_ablate.train.run import launched_as_rank_zero, train_run
from train_step import DEFAULTS, LightningClock, StepClock

RESULT = "result:"


def measure(args: argparse.Namespace) -> None:
    """One run on `args.processes` processes; rank 0 prints its training throughput."""
    torch.set_num_threads(args.threads)
    config = benchmark_config(args, f"train.devices={args.processes}")
    clock = StepClock(args.warmup, args.warmup + args.steps)
    state = train_run(config, args.run_dir, callbacks=(LightningClock(clock),))
    if launched_as_rank_zero():
        if state != "done":
            raise SystemExit(f"the {args.processes}-process run ended {state}")
        tokens = args.steps * config.train.batch_size * config.train.segment_len
        print(
            f"{RESULT} {tokens / clock.seconds:.0f} tokens/s "
            f"({1000 * clock.seconds / args.steps:.1f} ms/step)"
        )


def benchmark_config(args: argparse.Namespace, *overrides: str):
    return load_run_config(
        None,
        [
            *DEFAULTS,
            "eval.batch_size=2",
            "train.accelerator=cpu",
            f"train.max_steps={args.warmup + args.steps}",
            f"train.checkpoint_every={args.warmup + args.steps + 1}",
            *overrides,
            *args.overrides,
        ],
    )


def run(processes: int, args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory() as run_dir:
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            "--processes",
            str(processes),
            "--run-dir",
            run_dir,
            "--threads",
            str(args.threads),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            *(a for o in args.overrides for a in ("--set", o)),
        ]
        done = subprocess.run(argv, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        raise SystemExit(
            f"{processes} process(es) failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return lines[0].removeprefix(RESULT).strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument("--processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.processes:
        measure(args)
        return
    one, two = run(1, args), run(2, args)
    ratio = float(two.split()[0]) / float(one.split()[0])
    config = benchmark_config(args)
    print(
        f"CPU, {args.threads} thread(s) per process; d_model {config.model.d_model}, layers "
        f"{config.model.n_layers}, segment {config.train.segment_len} x global batch "
        f"{config.train.batch_size}, mem {config.model.mem_len}, {args.steps} timed steps"
    )
    print(f"1 process  : {one}")
    print(f"2 processes: {two}")
    print(f"2 processes / 1 process throughput: {ratio:.2f}")


if __name__ == "__main__":
    main()
