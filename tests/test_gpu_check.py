"""benchmarks/gpu_check.py (`make gpu-check`) without a GPU: its one-line answer; its plan of
phases, each a process with its own timeout, run while they fit the call's budget, a written phase
skipped (resume), a failed one recorded and skipped unless retried, never a half-written file; the
parity phase on CPU (every fast path against the explicit path in fp32 and bf16, and a wrong kernel
fails the check); the summary's TFLOP/s and MFU columns. Its run on CPU found FlexAttention's FoX
decay and CoPE's gate counts rounded to bf16 under autocast (both now in fp32). Run: pytest
tests/test_gpu_check.py -q -p no:cacheprovider"""

import json
import sys
from pathlib import Path

import pytest
import torch

from fixtures.runner import alive, wait_for
from relpos_ablate.config.presets import encoding_words
from relpos_ablate.model.kernels import blockwise as kernels

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_check  # noqa: E402
import gpu_check_phases  # noqa: E402
import gpu_check_report  # noqa: E402
import gpu_diagnose  # noqa: E402
import gpu_tests  # noqa: E402
import train_step  # noqa: E402


def test_without_a_gpu_it_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    # in this process, as `make gpu-check` runs it on a machine whose torch sees no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.splitlines() == [out] and "no GPU present" in out
    assert not list(tmp_path.iterdir())


def test_the_plan_puts_correctness_first_and_each_phase_under_its_timeout():
    args = gpu_check.parser().parse_args(
        ["--lengths", "1024,4096", "--shapes", "8x8x64,4x16x128", "--compiled-chunk", "16"]
    )
    phases = gpu_check.plan(args, torch.device("cuda"))  # (a plan only: nothing runs)
    names = [p.name for p in phases]
    parity = [f"parity-{b}-{d}" for b in ("flex", "sdpa", "blocks") for d in ("fp32", "bf16")]
    n = len(encoding_words())
    eager = [f"train_step-off-{k}of{-(-n // 8)}" for k in range(1, -(-n // 8) + 1)]
    compiled = [f"train_step-on-{k}of{-(-n // 16)}" for k in range(1, -(-n // 16) + 1)]
    attention = [
        f"attention-{shape}-L{n}" for n in (1024, 4096) for shape in ("8x8x64", "4x16x128")
    ]
    tail = ["grid_packing"]
    assert names == [*parity, "gpu_tests", "diagnose", "ddp", *attention, *eager, *compiled, *tail]
    timeout = {p.name: p.timeout for p in phases}
    assert timeout["parity-flex-fp32"] == 300 and timeout["parity-blocks-bf16"] == 150
    assert all(t <= args.budget for t in timeout.values())  # each fits one call
    attention = phases[names.index("attention-4x16x128-L4096")].command
    assert float(attention[attention.index("--deadline") + 1]) == 420 - gpu_check.ATTENTION_MARGIN
    assert attention[attention.index("--shape") + 1] == "4x16x128"
    assert attention[attention.index("--lengths") + 1] == "4096"
    chunks = [p.command[p.command.index("--presets") + 1] for p in phases if "-on-" in p.name]
    assert ",".join(chunks).split(",") == encoding_words()  # every preset, compiled
    cpu = gpu_check.parser().parse_args(["--phases", "parity-blocks-*,ddp,attention-*"])
    cpu.timeout = ["parity-blocks-fp32=30"]
    on_cpu = gpu_check.plan(cpu, torch.device("cpu"))  # DDP and attention: CUDA only
    assert [(p.name, p.timeout) for p in on_cpu] == [
        ("parity-blocks-fp32", 30.0),
        ("parity-blocks-bf16", 150.0),
    ]


def test_a_phase_that_could_never_fit_the_budget_is_refused_in_one_line(tmp_path):
    argv = ["--device", "cpu", "--out", str(tmp_path), "--timeout", "parity-*=900"]
    with pytest.raises(SystemExit, match="parity-flex-fp32's timeout \\(900 s\\) is over --budget"):
        gpu_check.main(argv)
    assert not list(tmp_path.iterdir())


def phase(name: str, timeout: float = 100.0, *command: str) -> "gpu_check.Phase":
    return gpu_check.Phase(name, command or ("true",), timeout)


class FakeLaunch:
    """Writes a phase's file (after a temporary file, as atomic_write_text) or fails it, leaving
    the temporary file of a write cut short; advances the fake clock by `seconds`."""

    def __init__(self, failing=(), seconds=10.0):
        self.failing, self.seconds, self.now, self.ran = set(failing), seconds, 0.0, []

    def __call__(self, phase, phases_dir):
        self.ran.append(phase.name)
        self.now += self.seconds
        (phases_dir / f".{phase.name}.json.abc.tmp").write_text("{")
        if phase.name in self.failing:
            return False, "exit code 1: boom"
        (phases_dir / f".{phase.name}.json.abc.tmp").replace(phases_dir / f"{phase.name}.json")
        (phases_dir / f"{phase.name}.json").write_text(json.dumps({"rows": []}))
        return True, ""


def test_a_written_phase_is_skipped_and_a_failed_one_leaves_no_file(tmp_path):
    phases = [phase("a"), phase("b"), phase("c")]
    launch = FakeLaunch(failing={"b"})
    what = gpu_check.run_phases(phases, tmp_path, 600, launch=launch, clock=lambda: launch.now)
    assert what["done"] == ["a", "c"] and what["failed"] == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "c.json", "state.json"]
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["b"] == {"state": "failed", "seconds": 10.0, "reason": "exit code 1: boom"}
    again = FakeLaunch()
    what = gpu_check.run_phases(phases, tmp_path, 600, launch=again, clock=lambda: again.now)
    assert again.ran == [] and what["written"] == ["a", "c"] and what["failed_before"] == ["b"]
    gpu_check.run_phases(phases, tmp_path, 600, retry_failed=True, launch=again)
    assert again.ran == ["b"] and (tmp_path / "b.json").exists()
    gpu_check.run_phases(phases, tmp_path, 600, force=True, launch=again)
    assert again.ran == ["b", "a", "b", "c"]


def test_a_call_starts_a_phase_only_while_its_timeout_fits_the_budget(tmp_path):
    """At 0 s and 80 s a phase of 100 s fits 250 s; at 160 s it does not, and nothing after it runs
    in this call, not even a short one: the phases keep their order."""
    phases = [phase("a"), phase("b"), phase("c"), phase("d", 10.0)]
    launch = FakeLaunch(seconds=80.0)
    what = gpu_check.run_phases(phases, tmp_path, 250, launch=launch, clock=lambda: launch.now)
    assert what["done"] == ["a", "b"] and what["left"] == ["c", "d"]
    launch.now = 0.0
    what = gpu_check.run_phases(phases, tmp_path, 250, launch=launch, clock=lambda: launch.now)
    assert what["written"] == ["a", "b"] and what["done"] == ["c", "d"] and not what["left"]


def test_a_phase_past_its_timeout_is_killed_with_its_children(tmp_path):
    pid = tmp_path / "child.pid"
    sleeper = (
        "import pathlib, subprocess, time; child = subprocess.Popen(['sleep', '60']); "
        f"pathlib.Path({str(pid)!r}).write_text(str(child.pid)); time.sleep(60)"
    )
    slow = phase("slow", 2.0, sys.executable, "-c", sleeper)
    assert gpu_check.launch(slow, tmp_path) == (False, "timeout after 2 s")
    wait_for(lambda: not alive(int(pid.read_text())), timeout=10)  # the child too
    crash = "print('step 1', flush=True); raise SystemExit('cuda out of memory')"
    ok, reason = gpu_check.launch(phase("crash", 30.0, sys.executable, "-c", crash), tmp_path)
    assert not ok and reason == "exit code 1: cuda out of memory"
    assert (tmp_path / "crash.log").read_text().startswith("step 1")


def run_in_process(phase, phases_dir):
    """The phase's command, run by its script's main in this process (no new interpreter)."""
    script, argv = Path(phase.command[1]).name, list(phase.command[2:])
    ({"gpu_check_phases.py": gpu_check_phases.main, "train_step.py": train_step.main}[script])(argv)
    return True, ""


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_parity_and_train_step_phases_run_on_cpu_into_one_summary(tmp_path):
    size = "--layers 1 --d-model 16 --heads 2 --d-head 16 --d-inner 32 --length 16 --batch 2"
    args = gpu_check.parser().parse_args(
        [
            *("--device", "cpu", "--out", str(tmp_path), "--schemes", "xl_abcd,bias_fire,fox"),
            *("--phases", "parity-*,train_step-*", "--presets", "nope,rope,alibi"),
            *("--compile", "off", "--train-step-args"),
            f"{size} --vocab 64 --steps 1 --warmup 1 --repeats 1",
        ]
    )
    phases = gpu_check.plan(args, torch.device("cpu"))
    gpu_check.run_phases(phases, tmp_path / "phases", 600, launch=run_in_process)
    env = gpu_check.environment(torch.device("cpu"))
    summary = gpu_check_report.summarise(tmp_path, env, [p.name for p in phases], "", 0)
    rows = summary["parity"]
    assert {(r["scheme"], r["backend"], r["dtype"]) for r in rows} == {
        (s, b, d)
        for s in ("xl_abcd", "bias_fire", "fox")
        for b in gpu_check_phases.BACKENDS
        for d in ("fp32", "bf16")
    }
    assert all(r["ok"] for r in rows) and not summary["failures"]
    # (no CPU flex backward)
    assert all(r["grad_error"] is not None for r in rows if r["backend"] != "flex")
    assert [r["scheme"] for r in summary["train_step"]["rows"]] == ["nope", "rope", "alibi"]
    assert {p["state"] for p in summary["phases"]} == {"done"}
    page = gpu_check_report.markdown(summary)
    assert "| fox | flex | bf16 |" in page and "| rope | off |" in page
    assert summary["device"] == "cpu" and summary["torch"] and "commit" in summary


def test_a_wrong_kernel_fails_the_check(tmp_path, monkeypatch):
    merged = kernels._merged
    monkeypatch.setattr(
        kernels, "_merged", lambda parts: (lambda out, lse: (out * 1.01, lse))(*merged(parts))
    )
    write = tmp_path / "phases" / "parity-all.json"
    argv = ["parity", "--device", "cpu", "--schemes", "bias_t5", "--write", str(write)]
    assert gpu_check_phases.main(argv) == 0  # failing rows are results, not a failed phase
    summary = gpu_check_report.summarise(tmp_path, {}, [], "", 0)
    assert {r["backend"] for r in summary["parity"] if not r["ok"]} == {"blocks"}
    assert summary["failures"] == ["bias_t5 blocks fp32", "bias_t5 blocks bf16"]


def test_the_attention_rows_carry_flashattentions_tflops_and_the_fraction_of_peak(tmp_path):
    """B = 2, H = 8, d_head = 64, causal forward + backward at L = 1024: 3.5 × 4·B·H·L²·d / 2 FLOPs;
    the scheme in 2 ms, FlashAttention in 1 ms, peak 989 TFLOP/s."""
    gpu_check_phases.set_shape(2, 8, 64)
    flops = 3.5 * 4 * 2 * 8 * 1024**2 * 64 / 2
    rates = gpu_check_phases.attention_rates({"ms": 2.0, "baseline_ms": 1.0}, 1024, 989.0)
    assert rates["tflops"] == pytest.approx(flops / 2e-3 / 1e12)
    assert rates["baseline_tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    assert rates["peak_fraction"] == pytest.approx(flops / 2e-3 / 989e12)
    assert (
        gpu_check_phases.attention_rates({"ms": 2.0, "baseline_ms": 1.0}, 1024, None)[
            "peak_fraction"
        ]
        is None
    )
    row = {"scheme": "alibi", "L": 1024, "ratio": 2.0, "ms": 2.0, "baseline_ms": 1.0, **rates}
    row.update(peak_mb=30.0, baseline_peak_mb=29.0)
    phases = tmp_path / "phases"
    phases.mkdir()
    attention = {"rows": [row, {"scheme": "t5", "L": 16384, "skipped": "time budget"}]}
    attention.update(B=2, H=8, d_head=64, peak_tflops=989.0)
    (phases / "attention-2x8x64-L1024.json").write_text(json.dumps(attention))
    summary = gpu_check_report.summarise(tmp_path, {"device": "NVIDIA H200"}, [], "", 0)
    page = "\n".join(gpu_check_report.attention_lines(summary["attention"]))
    tf = flops / 2e-3 / 1e12
    assert f"| alibi | 2×8×64 | 1024 | 2.00× | {tf:.1f} ({2 * tf:.1f}) | " in page
    assert f"{tf / 989:.1%} ({2 * tf / 989:.1%})" in page
    assert "| 30 (29) | missed (≤ 1.25×) |" in page  # 2.00× against ALiBi's 1.25×
    assert "| t5 | 2×8×64 | 16384 | time budget |" in page


def test_a_shape_sets_the_timed_layer_and_a_bad_one_is_refused():
    saved = (gpu_check_phases.bench.B, gpu_check_phases.bench.H, gpu_check_phases.bench.D_HEAD)
    try:
        gpu_check_phases.set_shape(*gpu_check_phases.parse_shape("8x8x128"))
        bench = gpu_check_phases.bench
        assert (bench.B, bench.H, bench.D_HEAD, bench.D_MODEL) == (8, 8, 128, 1024)
        flops = 3.5 * 4 * 8 * 8 * 2048**2 * 128 / 2
        rates = gpu_check_phases.attention_rates({"ms": 1.0, "baseline_ms": 1.0}, 2048, None)
        assert rates["tflops"] == pytest.approx(flops / 1e-3 / 1e12)
    finally:
        gpu_check_phases.set_shape(*saved)
    for bad in ("8x8", "8x0x64", "ax8x64"):
        with pytest.raises(SystemExit, match="is not BxHxD"):
            gpu_check_phases.parse_shape(bad)


@pytest.mark.parametrize(
    "scheme, ratio, memory, met",
    [
        ("rope", 1.09, 1.0, True),
        ("rope", 1.11, 1.0, False),
        ("fox", 1.25, 5.0, True),  # no memory goal for FoX
        ("xl_abcd", 2.4, 2.0, True),
        ("xl_abcd", 2.4, 2.1, False),  # term b: memory over 2x
        ("xl_abcd", 2.6, 1.0, False),
    ],
)
def test_the_goal_of_each_family(scheme, ratio, memory, met):
    row = {"scheme": scheme, "ratio": ratio, "peak_mb": memory * 100.0, "baseline_peak_mb": 100.0}
    assert gpu_check_report.goal_of(row)["goal_met"] is met
    assert gpu_check_report.goal_of({"scheme": "cope", "ratio": 9.0}) == {}
    assert gpu_check_report.goal_of({"scheme": "rope", "skipped": "time budget"}) == {}
    # timed, then out of memory measuring its peak: no goal judged, and no KeyError
    assert gpu_check_report.goal_of({"scheme": "terms_b", "ratio": 2.0, "error": "OOM"}) == {}


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


def test_the_summary_carries_the_diagnoses_and_the_packing(tmp_path):
    """Hand-made phase files of gpu_diagnose.py and grid_packing.py: one line per diagnosis (its
    tensors matching, those differing with their numbers, or why it did not run) and one per
    packing."""
    phases = tmp_path / "phases"
    phases.mkdir()
    judged = dict(hypothesis="c", dtype="fp32", name="fire_flex_fp32", backend="flex")
    rows = [
        {**judged, "tensor": "out", "error": 1e-6, "yardstick": 1e-6, "scale": 10.0},
        {**judged, "tensor": "mlp.0.bias", "error": 0.083, "yardstick": 5e-4, "scale": 535.0},
        dict(judged, name="fire_flex_float64", dtype="float64", skipped="no float64"),
        dict(judged, name="fire_blocks_fp32", backend="blocks", tensor="c", error="no gradient"),
        dict(judged, name="fire_explicit_fp32", backend="explicit", tensor="c", error=1e-6),
    ]
    for row in rows[:2]:
        row["verdict"] = gpu_diagnose.verdict(row["error"], row["yardstick"], row["scale"])
    diagnose = {"rule": gpu_diagnose.RULE, "fire_gradient": {"rows": rows}}
    diagnose["terms_abcd"] = {"rows": []}
    (phases / "diagnose.json").write_text(json.dumps(diagnose))
    packing = {
        "runs": 4,
        "steps": 600,
        "estimate": {"rows": [{"runs_per_device": 1, "estimate_s": 90}]},
    }
    packing["rows"] = [
        dict(runs_per_device=1, wall_s=100.0, runs_per_hour=144.0, speedup=1.0, all_done=True),
        dict(runs_per_device=2, wall_s=60.0, runs_per_hour=240.0, speedup=100 / 60, all_done=True),
        dict(runs_per_device=4, skipped="--deadline, at 290 s"),
        dict(runs_per_device=8, wall_s=50.0, runs_per_hour=288.0, speedup=None, all_done=False),
    ]
    packing["utilization"] = dict(
        util_mean=31.0, util_mean_active=40.0, peak_memory_mib=2048.0, total_memory_mib=81559.0
    )
    (phases / "grid_packing.json").write_text(json.dumps(packing))
    summary = gpu_check_report.summarise(tmp_path, {"device": "NVIDIA H100"}, [], "", 0)
    page = "\n".join(
        gpu_check_report.diagnose_lines(summary["diagnose"])
        + gpu_check_report.packing_lines(summary["grid_packing"])
    )
    assert "| fire_flex_fp32 flex fp32 | c | 1 of 2 | mlp.0.bias 0.083; 0.0005, 5.4e+02 |" in page
    assert "| fire_flex_float64 flex float64 | c | no float64 | |" in page
    assert "| fire_blocks_fp32 blocks fp32 | c | 0 of 1 | c: no gradient |" in page
    assert "| fire_explicit_fp32 explicit fp32 | c | the yardstick | |" in page
    assert "| 1 | 100 | 144 | 1.00× | yes | 90 |" in page
    assert "| 2 | 60 | 240 | 1.67× | yes | — |" in page
    assert "| 4 | --deadline, at 290 s | | | | |" in page
    assert "| 8 | 50 | 288 | — | no | — |" in page
    assert "utilization 31.0% on average (40.0% while a kernel ran)" in page


def test_the_cuda_tests_phase_reads_each_outcome_from_pytest(tmp_path):
    """benchmarks/gpu_tests.py on a test file of its own: pytest really runs, and each test's
    outcome comes back from its JUnit XML into the summary (failures named among the check's)."""
    (tmp_path / "test_cuda_things.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.gpu\n"
        "def test_fine():\n    assert True\n"
        "def test_wrong():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs CUDA')\n"
        "def test_elsewhere():\n    pass\n"
    )
    out = tmp_path / "phases"
    out.mkdir()
    argv = ["--write", str(out / "gpu_tests.json"), "--paths", str(tmp_path)]
    assert gpu_tests.main(argv) == 0
    result = json.loads((out / "gpu_tests.json").read_text())
    outcome = {r["test"].split("::")[-1]: r["outcome"] for r in result["rows"]}
    assert outcome == {"test_fine": "passed", "test_wrong": "failed", "test_elsewhere": "skipped"}
    assert (result["passed"], result["failed"], result["exit_code"]) == (1, 1, 1)
    summary = gpu_check_report.summarise(tmp_path, {"device": "NVIDIA H100"}, [], "", 0)
    assert [f.split("::")[-1] for f in summary["failures"]] == ["test_wrong"]
    page = "\n".join(gpu_check_report.gpu_tests_lines(summary["gpu_tests"]))
    assert "1 passed, 1 failed, 0 error, 1 skipped" in page
    assert "| failed | AssertionError: one is not two" in page
    assert "| skipped | needs CUDA |" in page
