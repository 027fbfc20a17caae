"""The speed benchmarks record what their numbers belong to: benchmarks/attention.py's JSON names
the processor, its flags, the cores, torch, the date, the denormal setting and the kernels
calibration chose; train_step.py --spec times every variant of a grid against its NoPE twin and
writes what `grid --dry-run` reads (its --presets mode, with the FLOP and MFU arithmetic:
tests/test_train_step_flops.py); swap_timing.py times a function against its version at another
revision in one process."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from fixtures.runner import write_spec
from relpos_ablate.model.kernels import low_rank
from relpos_ablate.model.kernels.materialised_maps import MaterialisedMaps

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_attention_benchmark_json_names_the_machine_and_the_kernels(tmp_path, monkeypatch):
    # its own cache (conftest): the choice is measured here
    monkeypatch.setenv("RELPOS_ABLATE_CALIBRATE", "1")
    bench = _load("attention")
    out = tmp_path / "bench.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "attention.py",
            "--lengths",
            "64",
            "--schemes",
            "alibi,t5",
            "--pairs",
            "1",
            "--memory",
            "none",
            "--out",
            str(out),
        ],
    )
    bench.main()
    result = json.loads(out.read_text())
    assert (
        result["processor"]
        and result["cores"] >= 1
        and result["torch"]
        and len(result["date"]) == 10
    )
    assert set(result["cpu_flags"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert result["denormals"] == "flushed"
    assert [row["scheme"] for row in result["rows"]] == ["alibi", "t5"]
    assert all(row["64"]["ratio"] > 0 for row in result["rows"])
    # ALiBi had two candidates in training (low-rank, block kernel): one measured choice; T5 one
    # candidate
    alibi = [entry for key, entry in result["kernel_choices"].items() if "distance_slope" in key]
    assert alibi and all(set(entry["seconds"]) == {"low_rank", "blocks"} for entry in alibi)
    assert all(
        entry["choice"] == min(entry["seconds"], key=entry["seconds"].get) for entry in alibi
    )


def test_train_step_times_every_variant_of_a_spec_against_nope(tmp_path, monkeypatch):
    bench = _load("train_step")
    spec = write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0, 1))
    out = tmp_path / "train_step.json"
    bench.time_spec(str(spec), steps=2, warmup=1, repeats=1, device="cpu", out=str(out))
    result = json.loads(out.read_text())
    assert result["spec"] == "g" and result["processor"] and result["steps"] == 2
    # seeds aside
    assert [row["variant"] for row in result["rows"]] == ["encoding=xl", "encoding=alibi"]
    for row in result["rows"]:
        assert row["seconds_per_step"] > 0 and row["nope_seconds_per_step"] > 0
        assert (
            abs(row["ratio_to_nope"] - row["seconds_per_step"] / row["nope_seconds_per_step"])
            < 1e-12
        )
        assert abs(row["steps_per_second"] * row["seconds_per_step"] - 1) < 1e-12


def test_the_low_rank_block_benchmark_names_the_machine_and_bounds_each_blocks_rounding(capsys):
    """benchmarks/low_rank_blocks.py (the block-size figures of docs/performance.md) at L = 256: a
    time per path, and per block size the output's error against its float64 softmax, within the
    tests' 1e-5 where the spread is at most 128 (SPREAD_LIMIT)."""
    _load("low_rank_blocks").main(["--length", "256"])
    out = capsys.readouterr().out
    assert "SPREAD_LIMIT 128.0" in out.splitlines()[0]
    assert "| SDPA causal, 72 channels |" in out and "| low-rank kernel, blocks of 256 |" in out
    rows = [
        line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "e-" in line
    ]
    errors = {r[0][2:]: float(r[2]) for r in rows}
    in_order = ["256, sums in order"] if low_rank.ordered_sums() else []
    assert list(errors) == ["64", "128", "256", "512", "1024", "4096", *in_order]
    assert all(errors[n] < 1e-5 for n in ("64", "128", "256", *in_order))


def test_swap_timing_runs_a_function_at_another_revision_beside_the_current_one(capsys):
    """benchmarks/swap_timing.py: the attribute's source at the revision (HEAD here, which any clone
    has) is run as a module of its own and swapped in and out; the report gives both versions
    against SDPA-NoPE; a malformed swap or an attribute missing at the revision is a one-line
    error."""
    bench = _load("swap_timing")
    current = MaterialisedMaps._masked
    where = "relpos_ablate/model/kernels/materialised_maps.py"
    swap = bench.Swap(f"{where}:MaterialisedMaps._masked@HEAD")
    swap.set(old=True)
    assert MaterialisedMaps._masked is swap.old is not current
    assert (
        swap.old.__globals__["__name__"]
        == f"relpos_ablate.model.kernels.materialised_maps@HEAD:{where}"
    )
    swap.set(old=False)
    assert MaterialisedMaps._masked is current
    bench.main(
        [
            "--scheme",
            "fire",
            "--length",
            "64",
            "--rounds",
            "1",
            "--swap",
            "relpos_ablate/model/kernels/materialised_maps.py:MaterialisedMaps._masked@HEAD",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fire at L=64, 1 rounds") and lines[1].startswith("  old: median")
    assert lines[2].startswith("  new: median") and lines[3].startswith("  sdpa_nope: median")
    assert MaterialisedMaps._masked is current
    with pytest.raises(SystemExit, match="not FILE:QUALNAME@REV"):
        bench.Swap("relpos_ablate/model/kernels/block_maps.py@HEAD")
    with pytest.raises(SystemExit, match="MaterialisedMaps._absent is not defined"):
        bench.Swap("relpos_ablate/model/kernels/materialised_maps.py:MaterialisedMaps._absent@HEAD")
