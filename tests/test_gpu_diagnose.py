"""benchmarks/gpu_diagnose.py without a GPU: on the CPU (--small) it runs end to end, its
FlexAttention rows say skipped and the block kernel's rows match float64 by the script's rule (the
flex rows run on CUDA only: a case that raises there is a row, not a lost phase); the verdict rule
on hand-made numbers; the time budget and a raising case recorded as rows. Run: pytest
tests/test_gpu_diagnose.py -q -p no:cacheprovider"""

import json
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_diagnose  # noqa: E402

FLEX_CASES = {
    "fire_flex_fp32",
    "fire_flex_float64",
    *(f"captured_{kind}" for kind in gpu_diagnose.CAPTURED),
    "abcd",
}


def diagnose(tmp_path, *extra) -> dict:
    out = tmp_path / "diagnose.json"
    assert gpu_diagnose.main(["--device", "cpu", "--small", "--write", str(out), *extra]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["diagnose.json"]  # no temporary file left
    return json.loads(out.read_text())


def test_on_the_cpu_flex_rows_are_skipped_and_the_block_kernel_matches_float64(tmp_path):
    result = diagnose(tmp_path)
    fire, abcd = result["fire_gradient"]["rows"], result["terms_abcd"]["rows"]
    flex_rows = [r for r in fire + abcd if r.get("backend") == "flex"]
    assert {r["name"] for r in flex_rows} == FLEX_CASES
    assert all(r["skipped"] == gpu_diagnose.NO_BACKWARD and "error" not in r for r in flex_rows)
    assert {r["hypothesis"] for r in fire} == {"a", "b", "c"}
    # hypothesis b's dense fp32 scores against float64 (the yardstick) ran
    assert all(0 < r["dense_yardstick"] < 1e-4 for r in fire if r["hypothesis"] == "b")
    assert [r for r in abcd if r["tf32"]] == [
        dict(name="abcd", dtype="fp32", tf32=True, skipped="TF32 is CUDA only")
    ]

    blocks = [r for r in fire + abcd if r.get("backend") == "blocks"]
    names = {r["name"] for r in blocks}
    assert names == {"fire_blocks_fp32", "fire_blocks_float64", "abcd"}
    assert {"out", "x", "q_net.weight", "bias_scheme.mlp.0.bias"} <= {r["tensor"] for r in blocks}
    assert [r for r in blocks if r["verdict"] != "matches"] == []
    float64 = [r for r in blocks if r["dtype"] == "float64" and r["scale"] > 1]
    assert float64 and all(r["error"] < 1e-9 * r["scale"] for r in float64)
    q_grad = next(r for r in abcd if r.get("backend") == "blocks" and r["tensor"] == "q_net.weight")
    assert q_grad["entries"] == 512 and q_grad["entrywise_failures"] == 0
    explicit = [r for r in abcd if r.get("backend") == "explicit"]
    assert explicit and all(r["error"] > 0 and "verdict" not in r for r in explicit)


def test_the_verdict_rule():
    # the CUDA observation: FIRE's first MLP bias off by 0.083 where the fp32 explicit path erred
    # 5e-4 at scale 535 (16 * 5e-4 + 2e-5 * 535 = 0.0187)
    assert gpu_diagnose.verdict(0.083, 5e-4, 535.0) == "differs"
    assert gpu_diagnose.verdict(0.0058, 5e-4, 535.0) == "matches"
    assert gpu_diagnose.verdict(16 * 1e-3 + 2e-5 * 100, 1e-3, 100.0) == "matches"  # the bound
    assert gpu_diagnose.verdict(16 * 1e-3 + 2.1e-5 * 100, 1e-3, 100.0) == "differs"
    # a cancelled tensor (a per-head constant's gradient, ~0 in float64): the yardstick carries it
    assert gpu_diagnose.verdict(3.5e-3, 3.4e-4, 1.5e-12) == "matches"
    assert gpu_diagnose.verdict(1e-9, 0.0, 0.0) == "differs"
    assert gpu_diagnose.verdict(float("nan"), 1.0, 1.0) == "differs"


def test_a_case_past_the_deadline_or_raising_is_a_row(monkeypatch):
    monkeypatch.setattr(gpu_diagnose, "flex_backward", lambda device: True)
    base = dict(name="abcd", backend="flex")
    late = gpu_diagnose.Runner(torch.device("cpu"), deadline=-1.0)
    assert late.flex(base, list) == [{**base, "skipped": "time budget"}]

    def fails():
        raise RuntimeError("no float64 lowering\nand more")

    runner = gpu_diagnose.Runner(torch.device("cpu"), deadline=100.0)
    assert runner.flex(base, fails) == [{**base, "error": "RuntimeError: no float64 lowering"}]
    assert runner.flex(base, lambda: [{"tensor": "x"}]) == [{"tensor": "x"}]
