"""benchmarks/gpu_check.py (`make gpu-check`) without a GPU: its one-line answer, and its parity
logic on CPU (the CUDA parts, DDP and timing, skipped): every fast path against the explicit path in
fp32 and bf16, and a wrong kernel fails the check. Its run on CPU found FlexAttention's FoX decay
and CoPE's gate counts rounded to bf16 under autocast (both now in fp32). Run: pytest
tests/test_gpu_check.py -q"""

import json
import sys
from pathlib import Path

import pytest
import torch

from relpos_ablate.model.kernels import blockwise as kernels

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402


def test_without_a_gpu_it_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    # in this process, as `make gpu-check` runs it on a machine whose torch sees no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.splitlines() == [out] and "no GPU present" in out
    assert not list(tmp_path.iterdir())


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_parity_part_runs_on_cpu(tmp_path):
    schemes = "xl_abcd,bias_fire,fox,cope,window_sinks_fox"
    assert gpu_check.main(["--device", "cpu", "--schemes", schemes, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["parity"]
    assert {(r["scheme"], r["backend"], r["dtype"]) for r in rows} == {
        (s, b, d)
        for s in schemes.split(",")
        for b in gpu_check.BACKENDS
        for d in ("fp32", "bf16")
        if gpu_check.runs_on(gpu_check.PARITY[s], b)
    }
    assert all(r["ok"] for r in rows)
    # (no CPU flex backward)
    assert all(r["grad_error"] is not None for r in rows if r["backend"] != "flex")
    assert "| fox | flex | bf16 |" in (tmp_path / "gpu_check.md").read_text()


def test_the_check_runs_in_parts(tmp_path):
    """--backends and --dtypes take one part of the parity (a GPU's 10-minute calls hold no whole
    check)."""
    assert (
        gpu_check.main(
            [
                "--device",
                "cpu",
                "--schemes",
                "bias_t5,fox",
                "--backends",
                "blocks",
                "--dtypes",
                "fp32",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["parity"]
    assert [(r["scheme"], r["backend"], r["dtype"], r["ok"]) for r in rows] == [
        ("bias_t5", "blocks", "fp32", True),
        ("fox", "blocks", "fp32", True),
    ]
    assert not list(tmp_path.glob(".*.tmp"))  # written to a temporary file and renamed


def test_a_wrong_kernel_fails_the_check(tmp_path, monkeypatch):
    merged = kernels._merged
    monkeypatch.setattr(
        kernels, "_merged", lambda parts: (lambda out, lse: (out * 1.01, lse))(*merged(parts))
    )
    assert gpu_check.main(["--device", "cpu", "--schemes", "bias_t5", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["parity"]
    assert {r["backend"] for r in rows if not r["ok"]} == {"blocks"}


def test_the_profile_script_names_where_the_time_goes(capsys):
    """benchmarks/profile_attention.py (the profiles of docs/performance.md): a table per scheme,
    SDPA first, the operators' shares of the scheme's own total; an unknown scheme is one line
    naming it. Its main, called in this process (a new interpreter would import torch again for
    nothing)."""
    import profile_attention

    profile_attention.main(["--scheme", "t5", "--length", "64", "--top", "3"])
    tables = [t for t in capsys.readouterr().out.split("\n\n") if "self CPU time in all" in t]
    assert [t.splitlines()[0].split(" at ")[0] for t in tables] == ["sdpa_nope", "t5"]
    for table in tables:
        shares = [
            int(line.rsplit("|", 2)[1].strip().rstrip("%")) for line in table.splitlines()[3:]
        ]
        assert len(shares) == 3 and shares == sorted(shares, reverse=True) and sum(shares) <= 101
    with pytest.raises(SystemExit) as bad:
        profile_attention.main(["--scheme", "nope_x"])
    assert bad.value.code == 2 and "--scheme: unknown ['nope_x']" in capsys.readouterr().err
