"""Shared test setup: small thread count (the CI machine has 2 cores), tests/ on sys.path (so every
subfolder imports the helpers of tests/fixtures/ as `fixtures.<module>`), --process-groups (make
test runs the tests marked process_group alone, after the rest), and the fixtures used by name
(`rand`, `fake_slurm`)."""

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures.attention import randomize

torch.set_num_threads(1)
# the kernels' fixed order, not a measured choice (kernels/calibration.py): a test's numbers never
# depend on the machine's load; the calibration tests switch it on with their own cache.
# Subprocesses inherit both.
os.environ["RELPOS_ABLATE_CALIBRATE"] = "0"
os.environ["RELPOS_ABLATE_CACHE"] = tempfile.mkdtemp(prefix="relpos_ablate_cache_")


def pytest_addoption(parser):
    parser.addoption(
        "--process-groups",
        choices=("with", "skip", "only"),
        default="with",
        help="tests marked process_group: run them with the rest (default), skip them, or run only "
        "them. make test runs the rest on pytest-xdist workers, then these alone",
    )


def pytest_collection_modifyitems(config, items):
    """The torch.compile tests first, then deselect by --process-groups.

    The first compilation in a process costs ~13 s before its own graphs (Inductor's imports, its
    probe of the vector ISA, the precompiled header; ~20 s with an empty compile cache): run first,
    all of them land on one pytest-xdist worker (worksteal hands the first half of the list to one
    worker and takes tests from the end of a queue) and pay it once, not once a worker.

    A process group's ranks wait on each other at every step, so a rank that shares the cores with
    other tests stalls the rest: test_ddp_parameters' check takes ~9 s alone and took 120 s beside
    other work on 2 cores. (Its runs past the 240 s deadline were a deadlock on exit, not this: see
    that test.)"""
    # stable: order kept otherwise
    items.sort(key=lambda item: not item.path.name.startswith("test_compiled_"))
    mode = config.getoption("--process-groups")
    if mode == "with":
        return
    keep, dropped = [], []
    for item in items:
        (
            keep
            if (item.get_closest_marker("process_group") is not None) == (mode == "only")
            else dropped
        ).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def rand():
    return randomize


FAKE_SBATCH = """#!/bin/sh
cp "$1" "{record}/script_$(ls {record} | wc -l).sh"
echo "$@" >> "{record}/calls.txt"
echo "Submitted batch job 4242"
"""


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """`sbatch` that records its script and answers with a job id; `srun` so submitit sees a
    cluster."""
    bin_dir, record = tmp_path / "bin", tmp_path / "sbatch_record"
    bin_dir.mkdir()
    record.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH.format(record=record))
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return record
