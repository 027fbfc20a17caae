"""Shared helpers for the runner tests (no tests here): a fake worker and small grid specs.

The fake worker stands in for `python -m relpos_ablate train` (through RELPOS_ABLATE_WORKER) so the
scheduling, locking and fault tests run in seconds: it reads config.yaml, "trains" max_steps steps
(a checkpoint file and a metrics row per step, status.json like train), resumes from its checkpoint,
and logs every start and end to FAKE_WORKER_LOG, so tests count executions independently of the
runner. FAKE_BEHAVIOUR maps a seed to: fail (records failed, exit 1), crash (exception before any
status), sigkill (kills itself half way on its first attempt), slow_first (1 s steps until resumed).
Run as a script: python tests/test_runner_support.py --run-dir DIR --threads N
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

FAKE_WORKER = Path(__file__).resolve()
REPO = FAKE_WORKER.parent.parent


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _log(event: str, run_dir: Path, **fields) -> None:
    record = {"event": event, "run": run_dir.name, "pid": os.getpid(), "ppid": os.getppid(), "t": time.time(), **fields}
    with open(os.environ["FAKE_WORKER_LOG"], "a") as f:
        f.write(json.dumps(record) + "\n")


def fake_train(run_dir: Path, threads: int) -> int:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    seed, max_steps = config["seed"], config["train"]["max_steps"]
    behaviour = json.loads(os.environ.get("FAKE_BEHAVIOUR", "{}")).get(str(seed), "ok")
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    first_step = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    _log("start", run_dir, start_step=first_step, threads=threads, omp=os.environ.get("OMP_NUM_THREADS"),
         cuda=os.environ.get("CUDA_VISIBLE_DEVICES"))
    if behaviour == "crash":
        raise RuntimeError("simulated crash before the run could log anything")
    status = {"state": "running", "pid": os.getpid(), "started_at": time.time(), "step": first_step,
              "max_steps": max_steps}

    def on_sigterm(signum, frame):
        _write_json(run_dir / "status.json", {**status, "state": "interrupted", "reason": "SIGTERM"})
        _log("end", run_dir, state="interrupted")
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_sigterm)
    _write_json(run_dir / "status.json", status)
    step_s = float(os.environ.get("FAKE_STEP_S", "0.05"))
    for step in range(first_step + 1, max_steps + 1):
        time.sleep(1.0 if behaviour == "slow_first" and first_step == 0 else step_s)
        _write_json(ckpt, {"step": step})
        with open(run_dir / "metrics.csv", "a") as f:
            f.write(f"{step},{1.0 / step}\n")
        status.update(step=step, last_metric={"loss": 1.0 / step})
        _write_json(run_dir / "status.json", status)
        if behaviour == "fail" and step == 2:
            _write_json(run_dir / "status.json", {**status, "state": "failed", "reason": "loss is nan at step 2"})
            _log("end", run_dir, state="failed")
            return 1
        if behaviour == "sigkill" and first_step == 0 and step == max_steps // 2:
            os.kill(os.getpid(), signal.SIGKILL)
    _write_json(run_dir / "eval.json", {"main_metric": "acc", "settings": []})
    _write_json(run_dir / "status.json", {**status, "state": "done", "wall_time_s": time.time() - status["started_at"]})
    _log("end", run_dir, state="done")
    return 0


def fake_env(log: Path, behaviour: dict | None = None, step_s: float = 0.05) -> dict[str, str]:
    """Environment variables that make the runner launch the fake worker."""
    return {
        "RELPOS_ABLATE_WORKER": f"{sys.executable} {FAKE_WORKER}",
        "FAKE_WORKER_LOG": str(log),
        "FAKE_BEHAVIOUR": json.dumps({str(k): v for k, v in (behaviour or {}).items()}),
        "FAKE_STEP_S": str(step_s),
    }


def read_log(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def tiny_base(max_steps: int = 6) -> dict:
    """A valid run config small enough for the real `train` command (and read by the fake)."""
    return {
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_head": 16, "d_inner": 64, "dropout": 0.0},
        "data": {"source": "synthetic", "task": "offset_copy", "num_symbols": 8, "offset": 4,
                 "train_tokens": 2048, "eval_tokens": 256},
        "train": {"segment_len": 16, "batch_size": 4, "max_steps": max_steps, "warmup_steps": 2,
                  "log_every": 2, "checkpoint_every": 2, "accelerator": "cpu"},
        "eval": {"settings": [{"segment_len": 16}, {"segment_len": 32}], "batch_size": 4},
    }


def write_spec(directory: Path, name: str = "g", encodings=("xl", "alibi"), seeds=(0, 1), max_steps: int = 6,
               **extra) -> Path:
    spec = {"name": name, "base": tiny_base(max_steps), "grid": {"encoding": list(encodings)},
            "seeds": list(seeds), **extra}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--threads", type=int, required=True)
    cli = parser.parse_args()
    sys.exit(fake_train(cli.run_dir, cli.threads))
