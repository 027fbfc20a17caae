"""benchmarks/grid_packing.py: the same small grid run with 1, 2, ... runs at once on one device,
its throughput, the GPU's utilization while it ran and the runner's estimate against the measured
time. Here on CPU (a tiny model; nvidia-smi a stand-in), and its pure helpers against hand-computed
values."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relpos_ablate.runner.grid import load_grid

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "grid_packing.py"


def _load():
    spec = importlib.util.spec_from_file_location("grid_packing_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


packing = _load()


def test_the_utilization_summary_of_hand_made_samples():
    samples = [(0.0, 1000.0), (50.0, 1500.0), (100.0, 2500.0), (None, None), (30.0, 2000.0)]
    got = packing.summarise(samples, total_mib=10000.0, idle_mib=1000.0)
    assert got == {
        "samples": 4,  # the sample without a reading left out
        "util_mean": 45.0,  # (0 + 50 + 100 + 30) / 4
        "util_median": 40.0,  # (30 + 50) / 2
        "active_share": 0.75,  # 3 of 4 with a kernel running
        "util_mean_active": 60.0,  # (50 + 100 + 30) / 3
        "util_median_active": 50.0,
        "peak_memory_mib": 2500.0,
        "idle_memory_mib": 1000.0,
        "memory_added_mib": 1500.0,
        "total_memory_mib": 10000.0,
        "peak_memory_share": 0.25,
    }
    idle = packing.summarise([(0.0, None), (0.0, None)], total_mib=None, idle_mib=None)
    assert idle["util_mean"] == idle["util_mean_active"] == idle["active_share"] == 0.0
    assert idle["peak_memory_mib"] is idle["memory_added_mib"] is idle["peak_memory_share"] is None


def test_no_utilization_sample_is_no_summary():
    assert packing.summarise([], 80000.0, 500.0) is None
    assert packing.summarise([(None, 700.0)], 80000.0, 500.0) is None


@pytest.mark.parametrize(
    ("reading", "want"),
    [
        ("40, 2048", {"util_mean": 40.0, "peak_memory_mib": 2048.0, "memory_added_mib": 0.0}),
        ("[N/A], 2048", None),
    ],
)
def test_the_sampler_reads_nvidia_smi(tmp_path, monkeypatch, reading, want):
    """A stand-in nvidia-smi on PATH: the total for the memory.total query, else `reading`."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f'#!/bin/sh\ncase "$1" in *memory.total*) echo 81559 ;; *) echo "{reading}" ;; esac\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    sampler = packing.Sampler("cuda", every=0.05)
    assert (sampler.smi, sampler.gpu, sampler.total_mib) == (str(fake), "3", 81559.0)
    result, summary = sampler.during(lambda: time.sleep(0.2) or "ran")
    assert result == "ran"
    if want is None:
        assert summary is None
    else:
        assert summary["samples"] >= 2 and summary["total_memory_mib"] == 81559.0
        assert {key: summary[key] for key in want} == want
    assert packing.Sampler("cpu").during(lambda: 7) == (7, None)


@pytest.mark.parametrize("small", [False, True])
def test_the_specs_hold_the_runs_asked_for(tmp_path, small):
    for runs, encodings in ((4, {"rope", "alibi"}), (3, {"rope"})):
        for more, count in ((False, runs), (True, 2 * runs)):
            path = tmp_path / "spec.yaml"
            spec = packing.spec_dict(runs, 50, small, more_seeds=more)
            path.write_text(packing.spec_text(spec))
            grid = load_grid(path)
            assert len(grid.runs) == count and grid.name == packing.NAME
            assert {run.variant["encoding"] for run in grid.runs} == encodings
            assert all(run.config.train.max_steps == 50 for run in grid.runs)
    # the dry run's spec: the grid's runs, and the same ones under seeds + SEED_SHIFT
    assert packing.spec_dict(4, 50, small, more_seeds=True)["seeds"] == [0, 1, 1000, 1001]


@pytest.mark.slow
def test_a_cpu_grid_runs_end_to_end(tmp_path):
    """One packing of one run (the suite's time: packings differ by the runner's flags only, tested
    below with a stand-in Popen)."""
    out = tmp_path / "packing.json"
    command = [sys.executable, str(SCRIPT), "--write", str(out), "--device", "cpu", "--small"]
    command += ["--packing", "1", "--runs", "1", "--steps", "4"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"]["kind"] == "cpu" and result["runs"] == 1 and result["steps"] == 4
    assert result["warmup"] == {"skipped": "cpu: nothing is compiled"}
    (row,) = result["rows"]
    assert row["runs_per_device"] == 1 and row["all_done"] and row["exit_code"] == 0
    assert list(row["states"].values()) == ["done"]
    assert row["wall_s"] > 0 and row["runs_per_hour"] == pytest.approx(3600 / row["wall_s"])
    assert row["runs_wall_time_s"] > 0 and row["speedup"] == 1.0
    assert row["utilization"] is None and result["utilization"] is None  # no GPU to sample
    # the dry run estimates the same run under another seed from the finished one
    assert result["estimate"]["source"] == "1 finished run(s) of this spec"
    (guess,) = result["estimate"]["rows"]
    assert guess["measured_s"] == row["wall_s"] and guess["estimate_s"] >= 0
    assert guess["ratio"] == pytest.approx(guess["estimate_s"] / row["wall_s"])
    assert guess["slots"] == 1
    assert result["spec"] == packing.spec_text(packing.spec_dict(1, 4, True))


def test_speedups_are_the_one_run_wall_over_each_wall():
    rows = [{"wall_s": 100.0}, {"wall_s": 40.0}, {"runs_per_device": 4, "skipped": "--deadline"}]
    packing.add_speedups(rows, {1: 100.0, 2: 40.0})
    assert [r["speedup"] for r in rows] == [1.0, 2.5, None]
    alone = [{"wall_s": 40.0}]
    packing.add_speedups(alone, {2: 40.0})
    assert alone[0]["speedup"] is None


class FakePopen:
    """subprocess.Popen's part grid() uses: records the command, and times out once where
    `hang`."""

    seen: dict = {}
    hang = False

    def __init__(self, command, **options):
        FakePopen.seen = dict(options, command=command, terminated=False)
        self.args, self.returncode = command, None

    def communicate(self, timeout=None):
        if FakePopen.hang and not FakePopen.seen["terminated"]:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = 130 if FakePopen.seen["terminated"] else 0
        return "out", "err"

    def terminate(self):
        FakePopen.seen["terminated"] = True


@pytest.mark.parametrize(
    ("device", "flags"),
    [("cuda", ["--devices", "0", "--runs-per-device", "2"]), ("cpu", ["--slots", "2"])],
)
def test_a_packing_is_the_grid_command_s_flags(monkeypatch, tmp_path, device, flags):
    monkeypatch.setattr(FakePopen, "hang", False)
    monkeypatch.setattr(packing.subprocess, "Popen", FakePopen)
    spec, results = tmp_path / "spec.yaml", tmp_path / "n2"
    done = packing.grid(spec, results, device, 2)
    want = ["-m", "relpos_ablate", "grid", str(spec), "--results", str(results)]
    command = FakePopen.seen["command"]
    assert command[0] == sys.executable and command[1:] == [*want, *flags]
    assert FakePopen.seen["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(SCRIPT.parent.parent)
    assert (done.returncode, done.stdout, done.stderr, done.stopped) == (0, "out", "err", False)


def test_a_grid_past_its_time_is_stopped_by_sigterm(monkeypatch, tmp_path):
    monkeypatch.setattr(FakePopen, "hang", True)
    monkeypatch.setattr(packing.subprocess, "Popen", FakePopen)
    done = packing.grid(tmp_path / "spec.yaml", tmp_path / "n1", "cpu", 1, timeout=5.0)
    assert FakePopen.seen["terminated"] and done.stopped and done.returncode == 130
