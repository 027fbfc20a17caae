"""The GPU check for the minutes a GPU is lent: `make gpu-check` (docs/performance.md, "The GPU
check"), in calls that each fit a 10-minute device call.

    python benchmarks/gpu_check.py                          # the phases not yet written that fit
    python benchmarks/gpu_check.py --phases 'attention-*'   # some phases (shell patterns)
    python benchmarks/gpu_check.py --device cpu --phases parity-blocks-fp32 --schemes bias_t5,fox

Every phase is one process with its own timeout (benchmarks/gpu_check_phases.py; the train-step
phases are benchmarks/train_step.py --presets), in this order: correctness first, then timings.

    parity-BACKEND-DTYPE      every scheme's fast path against the explicit one in float64 (flex,
                              sdpa, blocks × fp32, bf16)
    gpu_tests                 the suite's CUDA tests (pytest -m gpu; benchmarks/gpu_tests.py)
    diagnose                  FIRE's gradient on FlexAttention and terms abcd entry by entry, each
                              against float64 (benchmarks/gpu_diagnose.py)
    ddp                       a short Lightning DDP training on every visible GPU
    attention-BxHxD-L<L>      every scheme against FlashAttention at one shape and length: time
                              ratio, TFLOP/s and fraction of the dense bf16 peak, peak memory,
                              the issue's goal for the scheme's family met or missed
    train_step-MODE-KofN      the encoding presets at a researcher's size against NoPE, compile off
                              then on, --eager-chunk / --compiled-chunk presets a phase: step time,
                              tokens/s, peak memory, MFU
    grid_packing              a small grid with 1, 2, 4 runs on one GPU: wall time, speedup, the
                              GPU's utilization, the runner's estimate (benchmarks/grid_packing.py)

A phase's result, OUT/phases/NAME.json, appears only when the phase completes (a temporary file
renamed over it); a phase whose file exists is skipped unless --force, so calling the check again
resumes it. A phase that fails (non-zero exit, or its timeout: its process group is killed) is
recorded in OUT/phases/state.json with the reason (its output: OUT/phases/NAME.log) and skipped on
later calls unless --retry-failed, as the grid runner does with failed runs. A call starts a phase
only while its timeout fits in what is left of --budget seconds, then stops and says how many phases
are left. After every phase OUT/gpu_check.json and OUT/gpu_check.md summarise all written phases
(benchmarks/gpu_check_report.py) with the device, driver, torch and commit.

Timeouts from the H200 runs of benchmarks/results/gpu_check/ (about 9 s a FlexAttention compilation
with backward, about 10 s an attention cell with its compilation; ~19 compilations a flex parity
phase, 21 cells an attention phase); the train-step phases' are guesses, to be measured on the next
GPU. Change one with --timeout PATTERN=SECONDS. Without CUDA (and without --device cpu) the check
prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_check_phases import BACKENDS, PARITY, TIMED
from gpu_check_report import markdown, summarise
from grid_cost import COST_SPECS, WT103_VOCAB
from mfu import environment, required_peak_tflops
from relpos_ablate.config.presets import encoding_words
from relpos_ablate.io import atomic_write_text, read_json

HERE = Path(__file__).resolve().parent
#: (phase pattern, timeout in seconds): the first match wins.
TIMEOUTS = (
    ("parity-flex-*", 300),
    ("parity-*", 150),
    ("gpu_tests", 180),
    ("diagnose", 240),
    ("ddp", 180),
    ("grid_packing", 480),
    ("attention-*", 420),
    ("train_step-off-*", 420),
    ("train_step-on-*", 540),
)
ATTENTION_MARGIN = 90  # seconds an attention phase keeps for its imports and its last cell


@dataclass(frozen=True)
class Phase:
    name: str  # OUT/phases/<name>.json
    command: tuple[str, ...]  # the process, writing that file when it completes
    timeout: float


def timeout_of(name: str, overrides: dict[str, float]) -> float:
    table = [*overrides.items(), *TIMEOUTS]
    return next(float(seconds) for pattern, seconds in table if fnmatch.fnmatch(name, pattern))


def chunks(words: list[str], size: int) -> list[list[str]]:
    return [words[i : i + size] for i in range(0, len(words), size)]


def plan(args: argparse.Namespace, device: torch.device) -> list[Phase]:
    """Every phase of the check in order, those --phases selects (ddp and attention: CUDA only)."""
    phases_dir, py = Path(args.out) / "phases", sys.executable
    overrides = dict(item.split("=", 1) for item in args.timeout)
    found: list[Phase] = []

    def add(name: str, *command: str, write_flag: str = "--write") -> None:
        if any(fnmatch.fnmatch(name, pattern) for pattern in args.phases.split(",")):
            path = str(phases_dir / f"{name}.json")
            timeout = timeout_of(name, overrides)
            if name.startswith("attention-"):  # no cell starts after the phase's deadline
                command = (*command, "--deadline", str(timeout - ATTENTION_MARGIN))
            found.append(Phase(name, (py, *command, write_flag, path), timeout))

    peak = ["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else []
    phases_py, where = str(HERE / "gpu_check_phases.py"), ("--device", device.type)
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            options = ("--schemes", args.schemes, "--backends", backend, "--dtypes", dtype)
            add(f"parity-{backend}-{dtype}", phases_py, "parity", *where, *options)
    if device.type == "cuda":
        add("gpu_tests", str(HERE / "gpu_tests.py"))
        add("diagnose", str(HERE / "gpu_diagnose.py"), "--device", "cuda", "--deadline", "150")
        add("ddp", phases_py, "ddp", "--ddp-steps", str(args.ddp_steps))
        timing = ("--timed", args.timed, "--pairs", str(args.pairs), *peak)
        for length in args.lengths.split(","):
            for shape in args.shapes.split(","):
                cell = ("--lengths", length, "--shape", shape)
                add(f"attention-{shape}-L{length}", phases_py, "attention", *cell, *timing)
    words = encoding_words() if args.presets == "all" else args.presets.split(",")
    for mode in {"off": ["off"], "on": ["on"], "both": ["off", "on"]}[args.compile]:
        size = args.eager_chunk if mode == "off" else args.compiled_chunk
        parts = chunks(words, size)
        for k, part in enumerate(parts, 1):
            command = (str(HERE / "train_step.py"), "--presets", ",".join(part), "--compile", mode)
            extra = (*where, "--cost-specs", "", *peak, *shlex.split(args.train_step_args))
            add(f"train_step-{mode}-{k}of{len(parts)}", *command, *extra, write_flag="--out")
    if device.type == "cuda":
        add("grid_packing", str(HERE / "grid_packing.py"), "--packing", args.packing)
    return found


def launch(phase: Phase, phases_dir: Path) -> tuple[bool, str]:
    """Run the phase's process in a session of its own (output to NAME.log); on its timeout the
    whole group is killed (compile workers, DDP ranks). (ok, why not)."""
    log = phases_dir / f"{phase.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            phase.command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=phase.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False, f"timeout after {phase.timeout:.0f} s"
    if code == 0 and (phases_dir / f"{phase.name}.json").exists():
        return True, ""
    tail = (log.read_text().strip().splitlines() or ["no output"])[-1][:200]
    return False, f"exit code {code}: {tail}"


def run_phases(
    phases: list[Phase],
    phases_dir: Path,
    budget: float,
    force: bool = False,
    retry_failed: bool = False,
    launch: Callable[[Phase, Path], tuple[bool, str]] = launch,
    after_phase: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, list[str]]:
    """Run the phases in order (module docstring: skipped, failed, budget); the phases' names by
    what happened to them in this call: done, failed, written (skipped), failed_before, left."""
    phases_dir.mkdir(parents=True, exist_ok=True)
    state_path = phases_dir / "state.json"
    state = read_json(state_path) or {}
    start = clock()
    what = {k: [] for k in ("done", "failed", "written", "failed_before", "left")}
    for phase in phases:
        result = phases_dir / f"{phase.name}.json"
        if result.exists() and not force:
            what["written"].append(phase.name)
            continue
        if state.get(phase.name, {}).get("state") == "failed" and not (force or retry_failed):
            what["failed_before"].append(phase.name)
            continue
        if what["left"] or clock() - start + phase.timeout > budget:
            what["left"].append(phase.name)  # in order: nothing after a phase that did not fit
            continue
        result.unlink(missing_ok=True)  # --force: the old result goes before the new one is made
        print(f"gpu_check: {phase.name} (timeout {phase.timeout:.0f} s)", flush=True)
        begin = clock()
        ok, reason = launch(phase, phases_dir)
        for stale in phases_dir.glob(f".{phase.name}.*.tmp"):  # a write cut short by the kill
            stale.unlink()
        state[phase.name] = {"state": "done" if ok else "failed", "seconds": clock() - begin}
        if not ok:
            state[phase.name]["reason"] = reason
        atomic_write_text(state_path, json.dumps(state, indent=2) + "\n")
        what["done" if ok else "failed"].append(phase.name)
        print(f"gpu_check: {phase.name} {'done' if ok else 'FAILED: ' + reason}", flush=True)
        after_phase()
    return what


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--out", default="benchmarks/results/gpu_check", help="results folder")
    parser.add_argument("--phases", default="*", help="phases to run: shell patterns, commas")
    parser.add_argument(
        "--budget",
        type=float,
        default=570.0,
        help="seconds of phases in this call (default 570: with the start-up and the summary, "
        "under one 10-minute device call)",
    )
    parser.add_argument("--force", action="store_true", help="run written phases again")
    parser.add_argument("--retry-failed", action="store_true", help="run failed phases again")
    parser.add_argument(
        "--timeout", action="append", default=[], metavar="PATTERN=SECONDS", help="a timeout"
    )
    parser.add_argument(
        "--schemes", default="all", help="parity schemes, comma-separated: " + ", ".join(PARITY)
    )
    parser.add_argument("--backends", default=",".join(BACKENDS), help="parity backends")
    parser.add_argument("--dtypes", default="fp32,bf16", help="parity dtypes: fp32, bf16")
    parser.add_argument("--ddp-steps", type=int, default=20)
    parser.add_argument("--timed", default=",".join(TIMED), help="attention schemes")
    parser.add_argument(
        "--lengths", default="2048,8192,16384", help="attention: one phase per length and shape"
    )
    parser.add_argument(
        "--shapes",
        default="8x8x64,8x8x128",
        help="attention: BxHxD shapes (compute-bound: B·H >= 64), comma-separated",
    )
    parser.add_argument("--pairs", type=int, default=3, help="attention: timing pairs per cell")
    parser.add_argument("--presets", default="all", help="train step: encoding presets, commas")
    parser.add_argument("--packing", default="1,2,4", help="grid_packing: runs per GPU, commas")
    parser.add_argument("--compile", default="both", choices=("off", "on", "both"))
    parser.add_argument("--eager-chunk", type=int, default=8, help="presets a compile-off phase")
    parser.add_argument("--compiled-chunk", type=int, default=3, help="presets a compile-on phase")
    parser.add_argument(
        "--train-step-args", default="", help="more train_step.py flags, e.g. '--layers 6'"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="dense bf16 peak (mfu.py has a table)"
    )
    parser.add_argument("--cost-specs", default=COST_SPECS, help="specs to cost in device-hours")
    parser.add_argument("--cost-vocab", type=int, default=WT103_VOCAB, help="their vocabulary")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.device is None and not torch.cuda.is_available():
        print(
            "gpu_check: no GPU present (torch.cuda.is_available() is False); nothing checked "
            "(--device cpu runs the parity and train-step phases on CPU)"
        )
        return 0
    device, out = torch.device(args.device or "cuda"), Path(args.out)
    bad = [p for p in args.timeout if "=" not in p]
    if bad:
        raise SystemExit(f"gpu_check: --timeout {bad[0]!r} is not PATTERN=SECONDS")
    if device.type == "cuda":  # MFU and TFLOP/s need the peak: say so before any phase runs
        required_peak_tflops(device, args.peak_tflops)
    phases, env = plan(args, device), environment(device)
    too_long = [p for p in phases if p.timeout > args.budget]
    if too_long:  # it would never start
        raise SystemExit(
            f"gpu_check: {too_long[0].name}'s timeout ({too_long[0].timeout:.0f} s) is over "
            f"--budget ({args.budget:.0f} s): lower it with --timeout or raise --budget"
        )

    def write_summary() -> dict:
        summary = summarise(out, env, [p.name for p in phases], args.cost_specs, args.cost_vocab)
        atomic_write_text(out / "gpu_check.json", json.dumps(summary, indent=2) + "\n")
        atomic_write_text(out / "gpu_check.md", markdown(summary))
        return summary

    what = run_phases(
        phases,
        out / "phases",
        args.budget,
        args.force,
        args.retry_failed,
        after_phase=write_summary,
    )
    summary = write_summary()
    failures = summary["failures"]
    left = what["left"]
    print(
        f"gpu_check: {len(what['done'])} phase(s) done, {len(what['failed'])} failed, "
        f"{len(what['written'])} written before, {len(what['failed_before'])} failed before "
        f"(--retry-failed), {len(left)} left{' (run it again to go on)' if left else ''}; "
        f"{len(failures)} failure(s){': ' + ', '.join(failures) if failures else ''}; "
        f"wrote {out}/gpu_check.md"
    )
    return 1 if failures or what["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
