"""The GPU check's summary: every written phase of OUT/phases/ (benchmarks/gpu_check.py) merged into
one JSON and one Markdown page, with what the numbers belong to (device, driver, torch, commit),
the attention's TFLOP/s and fraction of peak, the train step's MFU, and the paper-scale specs'
device-hours (benchmarks/grid_cost.py)."""

from __future__ import annotations

from pathlib import Path

from grid_cost import cost_lines, costs
from mfu import environment_line
from relpos_ablate.io import read_json
from train_step_presets import rows_table


def summarise(out: Path, env: dict, planned: list[str], cost_specs: str, vocab: int) -> dict:
    """The summary of OUT/phases/: the phases' states (planned ones first), then their rows by
    kind; `failures` names each parity row that failed and a failed DDP run."""
    phases_dir = out / "phases"
    state = read_json(phases_dir / "state.json") or {}
    files = {p.stem: p for p in phases_dir.glob("*.json") if p.name != "state.json"}
    names = list(dict.fromkeys([*planned, *sorted(files), *state]))
    results = {n: read_json(files[n]) for n in names if n in files}
    phases = [
        {
            "phase": n,
            "state": "done" if n in results else state.get(n, {}).get("state", "pending"),
            "seconds": state.get(n, {}).get("seconds"),
            "reason": state.get(n, {}).get("reason"),
        }
        for n in names
    ]

    def rows(prefix: str) -> list[dict]:
        return [row for n, r in results.items() if n.startswith(prefix) for row in r["rows"]]

    parity, ddp = rows("parity-"), results.get("ddp")
    attention = [r for n, r in results.items() if n.startswith("attention-")]
    shape = ("B", "H", "d_head")
    attention_rows = [
        {**{k: r[k] for k in shape}, **row, **goal_of(row)}
        for n, r in results.items()
        if n.startswith("attention-")
        for row in r["rows"]
    ]
    train = [r for n, r in results.items() if n.startswith("train_step-")]
    train_rows = rows("train_step-")
    specs = [path for path in cost_specs.split(",") if path]
    failures = [f"{r['scheme']} {r['backend']} {r['dtype']}" for r in parity if not r["ok"]]
    if ddp and not ddp["ok"]:
        failures.append("ddp")
    tests = results.get("gpu_tests")
    if tests:
        failures += [r["test"] for r in tests["rows"] if r["outcome"] in ("failed", "error")]
    return {
        **env,
        "phases": phases,
        "parity": parity,
        "ddp": ddp,
        "attention": {
            "peak_tflops": attention[0]["peak_tflops"] if attention else None,
            "rows": attention_rows,
        },
        "train_step": {
            **({k: v for k, v in train[0].items() if k not in _PER_RUN} if train else {}),
            "rows": train_rows,
        },
        "costs": costs(train_rows, specs, vocab, train[0]["flops_per_step"]) if train else [],
        "gpu_tests": tests,
        "diagnose": results.get("diagnose"),
        "grid_packing": results.get("grid_packing"),
        "failures": failures,
    }


# what a train-step phase's JSON says about its own process (the summary's env says it once)
_PER_RUN = ("rows", "costs", "device", "cuda", "nvidia_driver", "torch", "processor", "date")


def markdown(summary: dict) -> str:
    lines = [
        f"# GPU check: {summary['device']}, torch {summary['torch']}",
        "",
        environment_line(summary),
        "",
        "| phase | state | seconds | why |",
        "|---|---|---|---|",
    ]
    for p in summary["phases"]:
        seconds = "—" if p["seconds"] is None else f"{p['seconds']:.0f}"
        lines.append(f"| {p['phase']} | {p['state']} | {seconds} | {p['reason'] or ''} |")
    lines += parity_lines(summary["parity"])
    if summary["ddp"]:
        d = summary["ddp"]
        lines += [
            "",
            f"DDP on {d['gpus']} GPU(s), {d['steps']} steps: {d['state']} in {d['seconds']:.0f} s",
        ]
    lines += gpu_tests_lines(summary.get("gpu_tests"))
    lines += diagnose_lines(summary.get("diagnose"))
    lines += attention_lines(summary["attention"])
    train = summary["train_step"]
    if train["rows"]:
        size = train["size"]
        lines += [
            "",
            f"## Train step against NoPE ({size['layers']} layers, d_model {size['d_model']}, "
            f"{size['heads']} heads × {size['d_head']}, L = {size['length']}, batch "
            f"{size['batch']}, vocabulary {size['vocab']}, {train['precision']})",
            "",
            f"FLOPs per step {train['flops_per_step']:.3e}: {train['flop_count']}. Peak "
            f"{train['peak_tflops'] or '—'} TFLOP/s. Memory: {train['memory']}.",
            "",
            *rows_table(train["rows"]),
            "",
            *cost_lines(summary["costs"]),
        ]
    lines += packing_lines(summary.get("grid_packing"))
    return "\n".join(lines) + "\n"


def gpu_tests_lines(result: dict | None) -> list[str]:
    """benchmarks/gpu_tests.py: the CUDA tests' counts, and each test that did not pass."""
    if not result:
        return []
    rows = result["rows"]
    counts = ", ".join(
        f"{sum(r['outcome'] == kind for r in rows)} {kind}"
        for kind in ("passed", "failed", "error", "skipped")
    )
    lines = ["", f"## The CUDA tests (pytest -m gpu): {counts}", ""]
    if not rows:
        return lines + [f"No test ran (pytest's exit code {result['exit_code']})."]
    others = [r for r in rows if r["outcome"] != "passed"]
    if others:
        lines += ["| test | outcome | message |", "|---|---|---|"]
        for r in others:
            message = r["message"].splitlines()[0] if r["message"] else ""
            lines.append(f"| {r['test']} | {r['outcome']} | {message.replace('|', '/')} |")
    return lines


def diagnose_lines(result: dict | None) -> list[str]:
    """benchmarks/gpu_diagnose.py's rows, one line per case: its tensors matching float64 by the
    rule, those that differ (with their error against the bound's terms) or have no value (an error
    message), or why the case did not run; the explicit path's rows are the yardstick."""
    if not result:
        return []
    lines = ["", "## Diagnoses (benchmarks/gpu_diagnose.py)", "", f"Rule: {result['rule']}.", ""]
    lines += ["| case | hypothesis | tensors matching | differing (error; yardstick, scale) |"]
    lines += ["|---|---|---|---|"]
    for part in ("fire_gradient", "terms_abcd"):
        cases: dict[str, list[dict]] = {}
        for row in result.get(part, {}).get("rows", []):
            key = f"{row['name']} {row.get('backend', '')} {row['dtype']}"
            key += " TF32" if row.get("tf32") else ""
            cases.setdefault(key, []).append(row)
        for key, rows in cases.items():
            hypothesis = rows[0].get("hypothesis", part)
            judged = [r for r in rows if "verdict" in r]
            failed = [r for r in rows if isinstance(r.get("error"), str)]
            skipped = next((r["skipped"] for r in rows if "skipped" in r), None)
            if not judged and not failed:
                lines.append(f"| {key} | {hypothesis} | {skipped or 'the yardstick'} | |")
                continue
            differ = [
                f"{r['tensor']} {r['error']:.2g}; {r['yardstick']:.2g}, {r['scale']:.2g}"
                for r in judged
                if r["verdict"] != "matches"
            ] + [f"{r.get('tensor', 'the case')}: {r['error']}" for r in failed]
            matching = len(judged) - sum(r["verdict"] != "matches" for r in judged)
            count = f"{matching} of {len(judged) + len(failed)}"
            lines.append(f"| {key} | {hypothesis} | {count} | {'; '.join(differ)} |")
    return lines


def packing_lines(result: dict | None) -> list[str]:
    """benchmarks/grid_packing.py: per packing, the wall time, runs per hour and speedup; the GPU's
    share one run uses; the runner's estimate against the measured time."""
    if not result:
        return []
    lines = [
        "",
        f"## A grid on one GPU ({result['runs']} runs of {result['steps']} steps, "
        "benchmarks/grid_packing.py)",
        "",
        "| runs at once | wall (s) | runs / hour | speedup | all done | estimate (s) |",
        "|---|---|---|---|---|---|",
    ]
    guesses = {r["runs_per_device"]: r for r in (result.get("estimate") or {}).get("rows", [])}
    for r in result["rows"]:
        n = r["runs_per_device"]
        if "skipped" in r:
            lines.append(f"| {n} | {r['skipped']} | | | | |")
            continue
        guess = guesses.get(n, {}).get("estimate_s")
        speedup = "—" if r["speedup"] is None else f"{r['speedup']:.2f}×"
        lines.append(
            f"| {n} | {r['wall_s']:.0f} | {r['runs_per_hour']:.0f} | {speedup} | "
            f"{'yes' if r['all_done'] else 'no'} | {'—' if guess is None else f'{guess:.0f}'} |"
        )
    use = result.get("utilization")
    if use:
        lines += [
            "",
            f"One run alone: GPU utilization {use.get('util_mean')}% on average "
            f"({use.get('util_mean_active')}% while a kernel ran), peak memory "
            f"{use.get('peak_memory_mib')} MiB of {use.get('total_memory_mib')} MiB.",
        ]
    return lines


def parity_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        f"## Parity: {sum(r['ok'] for r in rows)}/{len(rows)} ok",
        "",
        "| scheme | backend | dtype | output error | gradient error | ok |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        grad = "—" if r.get("grad_error") is None else f"{r['grad_error']:.1e}"
        out = "—" if r.get("out_error") is None else f"{r['out_error']:.1e}"
        lines.append(
            f"| {r['scheme']} | {r['backend']} | {r['dtype']} | {out} | {grad} | "
            f"{'ok' if r['ok'] else 'FAILED ' + r.get('error', '')} |"
        )
    return lines


#: issue 61's goals at compute-bound shapes, per scheme family: (time, peak memory) as multiples of
#: FlashAttention's without positions (None: no goal)
GOALS = {
    **dict.fromkeys(
        ("xl_table", "t5", "alibi", "alibi_learned", "kerple_log", "kerple_power", "fire"),
        (1.25, None),
    ),
    **dict.fromkeys(("dynamic", "sandwich", "terms_d", "fox"), (1.25, None)),
    **dict.fromkeys(("rope", "rope_partial", "p_rope", "rope_xpos", "rope_yarn"), (1.1, None)),
    **dict.fromkeys(("xl_abcd", "terms_b"), (2.5, 2.0)),  # term b
}


def goal_of(row: dict) -> dict:
    """The row's goal and whether it is met: {} for a scheme without one or a row without a time;
    memory is judged only where the family has a memory goal."""
    time_goal, memory_goal = GOALS.get(row["scheme"], (None, None))
    if time_goal is None or "ratio" not in row or "error" in row:  # (an error after the timing)
        return {}
    met = row["ratio"] <= time_goal
    if memory_goal is not None:
        met = met and row["peak_mb"] <= memory_goal * row["baseline_peak_mb"]
    return {"goal": (time_goal, memory_goal), "goal_met": met}


def attention_lines(attention: dict) -> list[str]:
    if not attention["rows"]:
        return []
    peak = attention["peak_tflops"]
    lines = [
        "",
        "## Attention against FlashAttention (bf16, causal, forward + backward)",
        "",
        "TFLOP/s by FlashAttention's count: 4·B·H·L²·d forward, halved when causal, × 3.5 with the "
        f"backward; of the dense bf16 peak, {peak or '—'} TFLOP/s. The projections' time is in "
        "the measured time, not in the count. Goal (issue 61): time (and peak memory) as multiples "
        "of FlashAttention's.",
        "",
        "| scheme | B×H×d_head | L | time / FlashAttention | TFLOP/s (FlashAttention) | of peak "
        "(FlashAttention) | peak MB (FlashAttention) | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in attention["rows"]:
        where = f"| {r['scheme']} | {r['B']}×{r['H']}×{r['d_head']} | {r['L']} |"
        if "skipped" in r or "error" in r:
            lines.append(f"{where} {r.get('skipped') or r.get('error')} | | | | |")
            continue
        fraction = (
            "—"
            if r["peak_fraction"] is None
            else f"{r['peak_fraction']:.1%} ({r['baseline_peak_fraction']:.1%})"
        )
        memory = f"{r['peak_mb']:.0f} ({r['baseline_peak_mb']:.0f})"
        goal = ""
        if "goal" in r:
            time_goal, memory_goal = r["goal"]
            limits = f"≤ {time_goal}×" + (f", memory ≤ {memory_goal}×" if memory_goal else "")
            goal = f"{'met' if r['goal_met'] else 'missed'} ({limits})"
        lines.append(
            f"{where} {r['ratio']:.2f}× | {r['tflops']:.1f} ({r['baseline_tflops']:.1f}) | "
            f"{fraction} | {memory} | {goal} |"
        )
    return lines
