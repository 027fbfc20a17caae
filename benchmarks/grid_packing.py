"""A grid's throughput on one device: the same small grid run with 1, 2, 4, ... runs at once.

    python benchmarks/grid_packing.py --write OUT.json                 # CUDA: GPU 0, 1,2,4 per GPU
    python benchmarks/grid_packing.py --write OUT.json --device cpu --small --packing 1,2 --runs 2

What it measures: a researcher's small grid (RoPE and ALiBi × seeds, 4 layers of d_model 128, 600
steps of 32 × 128 characters of the shipped Tiny Shakespeare, evaluated at 128 and 256; --small: a
1-layer d_model 32 model, 30 steps) is written into a temporary folder and, for each packing N, run
whole into a fresh results folder by `relpos-ablate grid SPEC --devices 0 --runs-per-device N`
(CPU: `--slots N`, the torch threads split between the slots), timed from the command's start to
its end (worker start-up, training, evaluation, the runner). On CUDA RoPE's attention is one SDPA
call and ALiBi's compiled FlexAttention (backend auto, kernels/dispatch.py), compiled in every
worker: an untimed 2-step grid of the same variants first (warmup, CUDA only) fills Inductor's
on-disk cache and the corpus's, so that the first packing does not pay what the later ones skip.

How to read it:
- rows: per packing N, wall_s, runs_per_hour (runs × 3600 / wall_s), speedup (N = 1's wall_s /
  wall_s), all_done (every RUN_DIR/status.json says done), runs_wall_time_s (the sum of the runs'
  own wall_time_s in status.json: what estimate.py builds on) and runner (the grid's own summary;
  slots busy: Σ worker time / (wall × slots)). A packing that would end past --deadline seconds,
  were it as long as the longest so far, is recorded as skipped; one still running 45 s past it is
  stopped (SIGTERM: the runner stops its workers) and says stopped_at_deadline.
- utilization: what share of the GPU the small run uses, from nvidia-smi every 0.5 s while the N =
  1 grid ran (each row has its own): util_mean / util_median over the whole grid, *_active over
  the samples where a kernel ran (util > 0: training and evaluation, not start-up), peak memory
  used against the total (memory_added_mib: above the idle memory sampled before the grid). None
  on CPU.
- estimate: what `relpos-ablate grid --dry-run` estimates (runner/estimate.py, called in process)
  on the N = 1 results, of the spec with its seeds and as
  many more (seed + 1000): the first are done, the others are the same runs to go, and
  runner/estimate.py takes each variant's seconds per step from the spec's finished runs, seeds
  aside (here the N = 1 runs' wall_time_s / step). Its estimate for N slots is what the runner
  predicts for this grid: against the measured wall_s, ratio < 1 means the estimate is short (it
  leaves out worker start-up, and assumes that packed runs keep their single-run speed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from relpos_ablate.io import atomic_write_text
from relpos_ablate.rundir import read_status

REPO, NAME, SEED_SHIFT = Path(__file__).resolve().parent.parent, "grid_packing", 1000
STOP_AFTER = 45  # a packing still running this many s past --deadline is stopped (SIGTERM)
NUMBER = re.compile(r"\d+(\.\d*)?")
RUNNER = re.compile(r"ran \d+ in [\d.]+s on \d+ slot\(s\), slots busy \d+%")


def spec_dict(runs: int, steps: int, small: bool, more_seeds: bool = False) -> dict:
    """`runs` runs: RoPE and ALiBi × runs // 2 seeds (odd: RoPE × runs seeds); more_seeds: the same
    runs again under seeds + SEED_SHIFT (the dry run's spec)."""
    encodings = ["rope", "alibi"] if runs % 2 == 0 else ["rope"]
    seeds = list(range(runs // len(encodings)))
    if small:
        model = dict(n_layers=1, d_model=32, n_heads=2, d_head=16, d_inner=64, dropout=0.0)
        length, batch, evals = 32, 8, [{"segment_len": 32, "max_targets": 2048}]
    else:
        model = dict(n_layers=4, d_model=128, n_heads=4, d_head=32, d_inner=512, dropout=0.0)
        length, batch, evals = 128, 32, [{"segment_len": 128}, {"segment_len": 256}]
    train = dict(segment_len=length, batch_size=batch, max_steps=steps, lr=3.0e-3)
    train.update(warmup_steps=min(30, steps // 5), log_every=10, checkpoint_every=steps)
    data = {"source": "text", "corpus": "tinyshakespeare", "tokenizer": "char"}
    return {
        "name": NAME,
        "base": {"model": model, "data": data, "train": train, "eval": {"settings": evals}},
        "grid": {"encoding": encodings},
        "seeds": seeds + [SEED_SHIFT + s for s in seeds] * more_seeds,
    }


def spec_text(spec: dict) -> str:
    return yaml.safe_dump(spec, sort_keys=False, default_flow_style=None, width=100)


def summarise(samples: list[tuple], total_mib: float | None, idle_mib: float | None) -> dict | None:
    """(utilization %, memory used MiB) samples (either may be None) -> the share of the GPU the
    grid used (module docstring); None without a utilization sample (CPU)."""
    util = [u for u, _ in samples if u is not None]
    if not util:
        return None
    active = [u for u in util if u > 0]
    peak = max((m for _, m in samples if m is not None), default=None)
    return {
        "samples": len(util),
        "util_mean": statistics.fmean(util),
        "util_median": statistics.median(util),
        "active_share": len(active) / len(util),
        "util_mean_active": statistics.fmean(active) if active else 0.0,
        "util_median_active": statistics.median(active) if active else 0.0,
        "peak_memory_mib": peak,
        "idle_memory_mib": idle_mib,
        "memory_added_mib": None if peak is None or idle_mib is None else peak - idle_mib,
        "total_memory_mib": total_mib,
        "peak_memory_share": None if peak is None or not total_mib else peak / total_mib,
    }


def _nvml(reader) -> float | None:
    try:
        return float(reader())
    except Exception:  # no NVML (pynvml), or a torch without this reader: not measured
        return None


class Sampler:
    """The GPU's utilization (%) and memory used (MiB), from nvidia-smi, else torch.cuda's NVML
    readers; nothing on CPU."""

    def __init__(self, device: str, every: float = 0.5):
        self.every = every  # seconds between samples
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.gpu = visible.split(",")[0] if visible else "0"  # --devices 0, as nvidia-smi names it
        self.smi = shutil.which("nvidia-smi") if device == "cuda" else None
        self.cuda = device == "cuda"
        self.total_mib = self.read("memory.total")[0] if self.cuda else None

    def read(self, fields: str = "utilization.gpu,memory.used") -> list[float | None]:
        if self.smi:
            query = [self.smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
            try:
                out = subprocess.run(
                    query + ["-i", self.gpu], capture_output=True, text=True, timeout=5
                )
            except (OSError, subprocess.SubprocessError):
                return [None, None]
            values = out.stdout.split(",")
            return [float(x) if NUMBER.fullmatch(x.strip()) else None for x in values] + [None]
        import torch

        if fields == "memory.total":
            return [torch.cuda.get_device_properties(0).total_memory / 2**20]
        used = lambda: torch.cuda.device_memory_used() / 2**20  # noqa: E731
        return [_nvml(torch.cuda.utilization), _nvml(used)]

    def during(self, work):
        """work()'s result, and the summary of samples taken every 0.5 s while it ran (None on
        CPU)."""
        if not self.cuda:
            return work(), None
        idle, samples, stop = self.read()[1], [], threading.Event()

        def loop() -> None:
            while not stop.wait(self.every):
                samples.append(tuple(self.read()[:2]))

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            result = work()
        finally:
            stop.set()
            thread.join()
        return result, summarise(samples, self.total_mib, idle)


def grid(spec: Path, results: Path, device: str, n: int, timeout=None):
    """`relpos-ablate grid SPEC` on GPU 0 with n runs at once (CPU: n slots); past `timeout` s
    SIGTERM (the runner stops its workers, which checkpoint) and `stopped` set."""
    if device == "cuda":
        flags = ["--devices", "0", "--runs-per-device", str(n)]
    else:
        flags = ["--slots", str(n)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "relpos_ablate", "grid", str(spec), "--results", str(results)]
    env, pipe = dict(os.environ, PYTHONPATH=path), subprocess.PIPE
    proc = subprocess.Popen(command + flags, stdout=pipe, stderr=pipe, text=True, env=env)
    try:
        out, err, stopped = *proc.communicate(timeout=timeout), False
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err, stopped = *proc.communicate(), True
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    done.stopped = stopped
    return done


def packing_row(n: int, wall: float, folder: Path, proc, runs: int) -> dict:
    """One packing: its wall time and throughput, and every run's state (RUN_DIR/status.json)."""
    states, own = {}, 0.0
    for run_dir in sorted(path.parent for path in folder.glob("*/status.json")):
        status = read_status(run_dir) or {}
        states[run_dir.name] = status.get("state")
        own += status.get("wall_time_s") or 0.0
    done = len(states) == runs and all(state == "done" for state in states.values())
    runner = RUNNER.search(proc.stdout)
    row = {"runs_per_device": n, "wall_s": wall, "runs_per_hour": runs * 3600 / wall}
    row.update(all_done=done, states=states, runs_wall_time_s=own, exit_code=proc.returncode)
    row.update(runner=runner.group(0) if runner else None, stopped_at_deadline=proc.stopped)
    if not done or proc.returncode:
        row["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
    return row


def estimate(spec: dict, tmp: Path, walls: dict[int, float]) -> dict:
    """What `grid --dry-run` estimates (runner/estimate.py, called here as the CLI calls it) for
    the spec with more seeds on the N = 1 results, on N slots for each packing."""
    from relpos_ablate.runner.estimate import estimate as runner_estimate
    from relpos_ablate.runner.grid import load_grid
    from relpos_ablate.runner.store import plan_grid

    (tmp / "more.yaml").write_text(spec_text(spec))
    plans = plan_grid(load_grid(tmp / "more.yaml"), tmp / "n1", False)
    rows, source = [], None
    for n, wall in walls.items():
        guess = runner_estimate(plans, tmp / "n1", NAME, n)
        seconds, source = (None, source) if guess is None else (guess.seconds, guess.source)
        row = {"runs_per_device": n, "slots": n, "estimate_s": seconds, "measured_s": wall}
        row["ratio"] = None if seconds is None else seconds / wall
        rows.append(row)
    return {"source": source, "seed_shift": SEED_SHIFT, "rows": rows}


def add_speedups(rows: list[dict], walls: dict[int, float]) -> None:
    """Each timed row's speedup: N = 1's wall time over its own (None without N = 1)."""
    for row in rows:
        row["speedup"] = walls[1] / row["wall_s"] if 1 in walls and "wall_s" in row else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", required=True, help="the JSON (written when it ends)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--packing", default="1,2,4", help="runs per device, comma-separated")
    parser.add_argument("--runs", type=int, default=4, help="runs in the grid (default 4)")
    parser.add_argument("--steps", type=int, help="training steps per run (600; --small: 30)")
    parser.add_argument("--small", action="store_true", help="a tiny model (the CPU test)")
    parser.add_argument(
        "--deadline", type=float, default=300.0, help="seconds: no packing that would end later"
    )
    args = parser.parse_args(argv)
    packing = [int(n) for n in args.packing.split(",")]
    if min([args.runs, args.steps or 1, *packing]) < 1 or len(set(packing)) < len(packing):
        parser.error("--runs, --packing, --steps: give numbers >= 1 (each packing once)")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible; use --device cpu")
    start, steps = time.perf_counter(), args.steps or (30 if args.small else 600)
    spec, variants = spec_dict(args.runs, steps, args.small), 2 - args.runs % 2
    sampler, rows, walls, headline = Sampler(args.device), [], {}, None
    with tempfile.TemporaryDirectory(prefix="grid_packing_") as folder:
        tmp = Path(folder)
        warmup = {"skipped": "cpu: nothing is compiled"}
        if args.device == "cuda":
            (tmp / "warm.yaml").write_text(spec_text(spec_dict(variants, 2, args.small)))
            print("grid_packing: warm-up (2 steps of each variant) ...", flush=True)
            warm = grid(
                tmp / "warm.yaml", tmp / "warm", args.device, variants, timeout=args.deadline
            )
            warmup = {"seconds": time.perf_counter() - start, "exit_code": warm.returncode}
            if warm.returncode:
                warmup["output_tail"] = (warm.stdout + warm.stderr)[-3000:]
        (tmp / "spec.yaml").write_text(spec_text(spec))
        for n in packing:
            elapsed = time.perf_counter() - start
            if walls and elapsed + max(walls.values()) > args.deadline:
                rows.append({"runs_per_device": n, "skipped": f"--deadline, at {elapsed:.0f} s"})
                continue
            print(f"grid_packing: {args.runs} runs, {n} at once ...", flush=True)
            t0 = time.perf_counter()
            stop = args.deadline + STOP_AFTER - elapsed
            proc, use = sampler.during(
                lambda n=n, stop=stop: grid(
                    tmp / "spec.yaml", tmp / f"n{n}", args.device, n, timeout=stop
                )
            )
            walls[n] = time.perf_counter() - t0
            rows.append(packing_row(n, walls[n], tmp / f"n{n}" / NAME, proc, args.runs))
            rows[-1]["utilization"], headline = use, use if n == 1 else headline
            print(f"grid_packing: {n} at once: {walls[n]:.1f} s", flush=True)
        add_speedups(rows, walls)
        more = spec_dict(args.runs, steps, args.small, more_seeds=True)
        guess = estimate(more, tmp, walls) if 1 in walls else None
    device = {"kind": args.device, "cores": os.cpu_count(), "processor": platform.processor()}
    if args.device == "cuda":
        device.update(name=torch.cuda.get_device_name(0), memory_total_mib=sampler.total_mib)
    result = {"phase": NAME, "device": device, "runs": args.runs}
    result.update(steps=steps, warmup=warmup, rows=rows, utilization=headline, estimate=guess)
    result.update(spec=spec_text(spec), seconds=time.perf_counter() - start)
    atomic_write_text(args.write, json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
