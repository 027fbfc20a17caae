"""Training throughput of the LightningModule (the real `train_run`, with its logger, status and
checkpoint callbacks) against the plain PyTorch loop in relpos_ablate/train/plain.py, same model and
data.

Both loops do identical work (tests/train/test_train_plain.py checks their losses agree step by
step), so the ratio is Lightning's overhead. Timing covers steps warmup..warmup+steps of each loop,
CUDA synchronised at both ends; the runs alternate and the median of `--repeats` is reported.

    python benchmarks/train_step.py                     # CPU, a small model
    python benchmarks/train_step.py --device cuda --set model.d_model=512 --set model.n_layers=8
    python benchmarks/train_step.py --compile           # also Lightning with train.compile: true

With --compile a third run, the LightningModule with `train.compile: true`, alternates with the
other two; its warm-up steps hold the compilation (with memory the first steps have other shapes:
warm up past them).

    python benchmarks/train_step.py --spec experiments/demo.yaml     # per variant of a grid
    python benchmarks/train_step.py --spec experiments/alibi_extrapolation_cpu.yaml --steps 20

With --spec, every variant of the grid (its first seed's run) trains `--steps` timed steps on the
plain loop with the run's own model, data and batch, alternating with the same model on NoPE (terms
'a', no position: the attention config's defaults), median of `--repeats`: seconds per step, steps
per second and the ratio to NoPE, written to results/<spec name>/train_step.json with the processor,
its flags, the cores, torch and the date. `relpos-ablate grid SPEC --dry-run` reads it to estimate
the grid's wall time where no run of the spec has finished yet (training steps only: evaluation and
start-up are not in it).

With --presets, every encoding preset at a researcher's size (12 layers, d_model 768, L = 2048,
batch 8 by default) against the same model without positions, compile off and on: step time,
tokens/s, peak memory and MFU, and what the paper-scale specs would cost in device-hours
(benchmarks/train_step_presets.py says how).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_step_presets  # benchmarks/: the --presets mode
from attention import machine  # the benchmark's record of the processor
from relpos_ablate.config import AttentionConfig, RunConfig, load_run_config
from relpos_ablate.config.run import resolve_log_n_length
from relpos_ablate.runner.grid import format_variant, load_grid
from relpos_ablate.train.data import build_datamodule
from relpos_ablate.train.plain import train_plain
from relpos_ablate.train.run import resolve_vocab, train_run

DEFAULTS = [
    "model.dropout=0.0",
    "model.mem_len=64",
    "data.train_tokens=65536",
    "data.eval_tokens=256",
    "train.log_every=10",
    "eval.settings=[{segment_len: 64}]",
    "eval.batch_size=1",
]


class StepClock:
    """Wall time from the end of step `start` to the end of step `stop` (optimizer steps,
    1-based)."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop, self.t0, self.seconds = start, stop, 0.0, 0.0

    def tick(self, done_steps: int) -> None:
        if done_steps in (self.start, self.stop):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if done_steps == self.start:
                self.t0 = time.perf_counter()
            else:
                self.seconds = time.perf_counter() - self.t0


class LightningClock(L.Callback):
    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_train_batch_end(self, trainer, *args) -> None:
        self.clock.tick(trainer.global_step)


def time_lightning(config: RunConfig, warmup: int, steps: int) -> float:
    clock = StepClock(warmup, warmup + steps)
    with tempfile.TemporaryDirectory() as run_dir:
        state = train_run(config, run_dir, callbacks=(LightningClock(clock),))
    if state != "done":
        raise RuntimeError(f"the Lightning run ended {state}")
    return clock.seconds


def time_plain(config: RunConfig, device: str, warmup: int, steps: int) -> float:
    clock = StepClock(warmup, warmup + steps)
    train_plain(
        config, device=device, steps=warmup + steps, on_step=lambda step: clock.tick(step + 1)
    )
    return clock.seconds


def time_spec(
    spec_path: str, steps: int, warmup: int, repeats: int, device: str, out: str | None
) -> None:
    """Seconds per training step of every variant of a grid spec and of its NoPE twin (module
    docstring)."""
    spec = load_grid(spec_path)
    variants: dict[str, object] = {}
    for run in spec.runs:  # the first seed's run of each variant
        variants.setdefault(
            format_variant({k: v for k, v in run.variant.items() if k != "seed"}), run
        )
    rows = []
    for name, run in variants.items():
        config = _timed_config(run.config, steps + warmup, device)
        nope_model = dataclasses.replace(
            config.model, attention=AttentionConfig(terms="a", causal=config.model.attention.causal)
        )
        nope = dataclasses.replace(config, model=nope_model)
        scheme_s, nope_s = [], []
        for _ in range(repeats):
            nope_s.append(time_plain(nope, device, warmup, steps) / steps)
            scheme_s.append(time_plain(config, device, warmup, steps) / steps)
        per_step, per_step_nope = statistics.median(scheme_s), statistics.median(nope_s)
        rows.append(
            {
                "variant": name,
                "max_steps": run.config.train.max_steps,
                "seconds_per_step": per_step,
                "steps_per_second": 1 / per_step,
                "nope_seconds_per_step": per_step_nope,
                "ratio_to_nope": per_step / per_step_nope,
            }
        )
        print(
            f"| {name} | {1 / per_step:8.2f} steps/s | {per_step / per_step_nope:5.2f}x NoPE |",
            flush=True,
        )
    result = {
        "spec": spec.name,
        "device": device,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        **machine(),
        "steps": steps,
        "warmup": warmup,
        "repeats": repeats,
        "rows": rows,
    }
    path = Path(out or Path("results") / spec.name / "train_step.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)
    print(f"wrote {path}")


def _timed_config(config: RunConfig, steps: int, device: str) -> RunConfig:
    """The run's config for a timing: `steps` steps on `device`, what a run fills in filled in (the
    vocabulary, log-n's training length)."""
    accelerator = "gpu" if device == "cuda" else "cpu"
    config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, max_steps=steps, accelerator=accelerator)
    )
    return resolve_log_n_length(resolve_vocab(config, build_datamodule(config).vocab_size))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per run (default 100; --presets 10)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 10; --presets 3)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs (--presets: pairs) per cell")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="both",
        default=None,
        choices=("off", "on", "both"),
        help="train.compile: without --presets, `--compile` also times Lightning compiled; with "
        "--presets off, on or both (default both)",
    )
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    parser.add_argument(
        "--spec", default=None, help="a grid spec: time every variant against its NoPE twin"
    )
    parser.add_argument(
        "--out",
        default=None,
        help="--spec, --presets: the JSON to write (default results/<spec>/train_step.json; "
        "benchmarks/results/train_step_presets.json, with its .md beside)",
    )
    train_step_presets.add_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    presets = args.presets is not None
    args.steps = args.steps or (10 if presets else 100)
    args.warmup = args.warmup if args.warmup is not None else (3 if presets else 10)
    if presets:
        args.compile = args.compile or "both"
        train_step_presets.run(args)
        return
    if args.spec:
        return time_spec(args.spec, args.steps, args.warmup, args.repeats, args.device, args.out)
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    config = load_run_config(
        None,
        [
            *DEFAULTS,
            f"train.accelerator={accelerator}",
            f"train.max_steps={args.warmup + args.steps}",
            f"train.checkpoint_every={args.warmup + args.steps + 1}",
            *args.overrides,
        ],
    )
    config = resolve_vocab(config, build_datamodule(config).vocab_size)
    tokens = args.steps * config.train.batch_size * config.train.segment_len
    compiled_config = dataclasses.replace(
        config, train=dataclasses.replace(config.train, compile=True)
    )
    lightning_s, plain_s, compiled_s = [], [], []
    for _ in range(args.repeats):
        plain_s.append(time_plain(config, args.device, args.warmup, args.steps))
        lightning_s.append(time_lightning(config, args.warmup, args.steps))
        if args.compile in ("on", "both"):
            compiled_s.append(time_lightning(compiled_config, args.warmup, args.steps))
    plain, lightning = statistics.median(plain_s), statistics.median(lightning_s)
    print(
        f"device {args.device}, d_model {config.model.d_model}, layers {config.model.n_layers}, "
        f"segment {config.train.segment_len} x batch {config.train.batch_size}, mem "
        f"{config.model.mem_len}, {args.steps} timed steps, median of {args.repeats}"
    )
    print(
        f"plain PyTorch : {tokens / plain:10.0f} tokens/s  ({1000 * plain / args.steps:.2f} "
        f"ms/step)"
    )
    print(
        f"Lightning     : {tokens / lightning:10.0f} tokens/s  "
        f"({1000 * lightning / args.steps:.2f} ms/step)"
    )
    print(f"Lightning / plain throughput: {plain / lightning:.3f}")
    if compiled_s:
        compiled = statistics.median(compiled_s)
        print(
            f"compiled      : {tokens / compiled:10.0f} tokens/s  "
            f"({1000 * compiled / args.steps:.2f} ms/step)"
        )
        print(f"Lightning compiled / Lightning throughput: {lightning / compiled:.3f}")


if __name__ == "__main__":
    main()
