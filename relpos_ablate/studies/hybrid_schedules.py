"""The report of the per-layer schedule study (`hybrid_schedules` on text,
`hybrid_schedules_retrieval` on the long-context tasks; the studies registry): every number its
README quotes, computed from the collected frame or the committed summary.csv.

Sections: what the papers claim (their own words, docs/schemes/schedules.md#layer-schedules),
perplexity per schedule and evaluation length, each schedule against all-RoPE at L and at the
longest length (two schedules: Welch's t-test), each schedule's perplexity at the longest length
against its own at L (the same runs: paired), and the retrieval tasks' exact match per test-length
bin against all-RoPE. Each section's tests are one family (analysis/stats.py), corrected together,
each difference with its 95% CI and the family's power line.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from relpos_ablate.analysis.stats import Family, listed
from relpos_ablate.analysis.table_options import axis_orders, read_spec
from relpos_ablate.analysis.tables import sort_key
from relpos_ablate.config import ConfigError

TEXT, RETRIEVAL = "hybrid_schedules", "hybrid_schedules_retrieval"
BASELINE = "rope"
# the text of results/hybrid_schedules/report.md, its lines as the report has them (E501 is
# suppressed at the string's end)
CLAIMS = """## What the papers say (their text), and what is tested here

- Cohere, "Rope to Nope and Back Again" (Yang et al. 2025, arXiv 2501.18795), abstract: a hybrid of local RoPE
  attention and global NoPE attention "not only surpasses conventional RoPE-based transformer models with full
  attention in both long and short context tasks but also delivers substantial efficiency gains". Tested: the
  `rnope` schedule against all-RoPE at L (short context) and at the longest length.
- SmolLM3 (Hugging Face blog): removing RoPE from every 4th layer "improves long context performance without
  affecting short context capabilities". Tested with the same comparisons, for `rnope` and `llama4_like` (NoPE
  every 4th layer).
- Golkar et al. 2024 (arXiv 2406.02585), abstract, on contextual counting: "no positional embeddings lead to the
  best accuracy, though rotary embeddings are competitive". Tested where the retrieval half has the task.
- Llama 4 and Gemma 3 publish layouts, not ablations of them: their rows are measured, with no claim to test.

These are claims about models of billions of parameters trained on up to trillions of tokens at contexts of
thousands; here a 6-layer model of width 64 is trained on characters at L = 64 (experiments/hybrid_schedules.yaml,
where the windows and chunks are scaled to L/4). A trend that does not show here is reported as not shown.
"""  # noqa: E501


def _done(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    if "encoding" not in df:
        raise ConfigError(
            "report", "the hybrid schedules report needs the `encoding` axis of its grids"
        )
    done = df[
        (df["status"] == "done") & np.isfinite(pd.to_numeric(df.get(metric), errors="coerce"))
    ].copy()
    return done


def _schedules(data: pd.DataFrame) -> list[str]:
    orders = axis_orders(read_spec(data))
    return sorted(set(data["encoding"]), key=lambda e: sort_key((e,), ["encoding"], orders))


def per_run(
    data: pd.DataFrame, schedule: str, protocol: str, length: int, metric: str = "ppl"
) -> dict[str, float]:
    """run dir -> the metric of one schedule under one setting (the run dir is the unit a test pairs
    on)."""
    rows = data[
        (data["encoding"] == schedule)
        & (data["protocol"] == protocol)
        & (data["segment_len"] == length)
    ]
    return {run: float(v) for run, v in zip(rows["run_dir"], rows[metric])}


def text_sections(df: pd.DataFrame, correction: str) -> list[str]:
    data = _done(df[df["experiment"] == TEXT], "ppl")
    if data.empty:
        return ["## Text\n\nNo finished run of `hybrid_schedules`.\n"]
    train = int(pd.to_numeric(data["train.segment_len"]).iloc[0])
    schedules = _schedules(data)
    settings = sorted(
        {(p, int(n)) for p, n in zip(data["protocol"], data["segment_len"])},
        key=lambda s: (s[0] != "non_overlapping", s[1]),
    )
    seeds = data.groupby("encoding")["seed"].nunique()
    head = (
        "| schedule | "
        + " | ".join(f"{p.replace('_', '-')} {n // train}L" for p, n in settings)
        + " |"
    )
    rows = [head, "|:---|" + "---:|" * len(settings)]
    for schedule in schedules:
        cells = []
        for protocol, n in settings:
            values = list(per_run(data, schedule, protocol, n).values())
            cells.append(
                f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"
                if len(values) > 1
                else (f"{values[0]:.3f}" if values else "—")
            )
        rows.append(f"| {schedule} | " + " | ".join(cells) + " |")
    longest = max(n for _, n in settings)
    parts = [
        f"## Text: perplexity per schedule and evaluation length\n\nCharacter perplexity on the "
        f"validation split of Tiny Shakespeare, mean ± std over seeds "
        f"({', '.join(sorted({str(s) for s in seeds}))} per schedule), trained at L = {train}; "
        f"non-overlapping segments of nL, and sliding windows of nL moved by L (every scored "
        f"character sees at least (n − 1)L + 1 of context).\n\n" + "\n".join(rows) + "\n"
    ]
    if BASELINE in schedules:
        family = Family("each schedule against all-RoPE", correction)
        items = []
        for protocol, n in [
            ("non_overlapping", train),
            ("non_overlapping", longest),
            ("sliding", longest),
        ]:
            base = per_run(data, BASELINE, protocol, n)
            if not base:
                continue
            for schedule in (s for s in schedules if s != BASELINE):
                items.append(
                    (
                        f"{protocol.replace('_', '-')} {n // train}L: ",
                        family.compare(
                            schedule,
                            per_run(data, schedule, protocol, n),
                            BASELINE,
                            base,
                            decimals=3,
                        ),
                    )
                )
        parts.append(
            "## Text: each schedule against all-RoPE (Welch's t-test over seeds)\n\nLower "
            "perplexity is better; the difference is the schedule's minus all-RoPE's.\n\n"
            + "\n".join(listed(items))
            + f"\n\n{family.summary()}\n"
        )
    family = Family("each schedule at its longest length against its own at L", correction)
    items = []
    for schedule in schedules:
        at_l = per_run(data, schedule, "non_overlapping", train)
        for protocol in ("non_overlapping", "sliding"):
            far = per_run(data, schedule, protocol, longest)
            if far and at_l:
                items.append(
                    (
                        f"{schedule}, {protocol.replace('_', '-')}: ",
                        family.compare(f"{longest // train}L", far, "L", at_l, decimals=3),
                    )
                )
    parts.append(
        "## Text: does perplexity hold beyond L? (paired t-test over the same runs)\n\n"
        + "\n".join(listed(items))
        + f"\n\n{family.summary()}\n"
    )
    return parts


def retrieval_sections(df: pd.DataFrame, correction: str) -> list[str]:
    data = _done(df[df["experiment"] == RETRIEVAL], "exact_match")
    if data.empty:
        return []
    data = data[data["length_max"].notna()].copy()
    data["bin"] = [
        f"n={int(lo)}-{int(hi)}" for lo, hi in zip(data["length_min"], data["length_max"])
    ]
    bins = sorted(set(data["bin"]), key=lambda b: int(b.split("=")[1].split("-")[0]))
    tasks = sorted(set(data["data.task"]))
    schedules = _schedules(data)
    parts = []
    family = Family("long-context task: each schedule against all-RoPE per bin", correction)
    items = []
    for task in tasks:
        mine = data[data["data.task"] == task]
        # one value per run and bin: the mean over its depths
        cell = mine.groupby(["encoding", "run_dir", "bin"])["exact_match"].mean()
        rows = ["| schedule | " + " | ".join(bins) + " |", "|:---|" + "---:|" * len(bins)]
        for schedule in schedules:
            values = [list(_bin(cell, schedule, b).values()) for b in bins]
            rows.append(
                f"| {schedule} | "
                + " | ".join(
                    f"{np.mean(v):.3f} ± {np.std(v, ddof=1):.3f}" if len(v) > 1 else "—"
                    for v in values
                )
                + " |"
            )
        parts.append(
            f"## Long-context task: {task}, exact match per test-length bin\n\nMean ± std over "
            f"seeds, each run's value the mean over its evaluated depths.\n\n"
            + "\n".join(rows)
            + "\n"
        )
        if BASELINE not in schedules:
            continue
        for b in bins[1:]:
            base = _bin(cell, BASELINE, b)
            for schedule in (s for s in schedules if s != BASELINE):
                items.append(
                    (
                        f"{task} {b}: ",
                        family.compare(
                            schedule,
                            _bin(cell, schedule, b),
                            BASELINE,
                            base,
                            lower_is_better=False,
                            decimals=3,
                        ),
                    )
                )
    if items:
        parts.append(
            "## Long-context task: each schedule against all-RoPE beyond the training lengths "
            "(Welch's t-test)\n\nHigher exact match is better; the difference is the schedule's "
            "minus all-RoPE's.\n\n" + "\n".join(listed(items)) + f"\n\n{family.summary()}\n"
        )
    return parts


def _bin(cell: pd.Series, schedule: str, b: str) -> dict[str, float]:
    if schedule not in cell.index.get_level_values(0):
        return {}
    values = cell.xs(schedule, level="encoding").xs(b, level="bin")
    return {run: float(v) for run, v in values.items() if math.isfinite(v)}


def report(df: pd.DataFrame, correction: str = "holm") -> str:
    runs = df[df["status"] == "done"]["run_dir"].nunique() if "status" in df else 0
    parts = [
        "# hybrid_schedules: derived numbers\n",
        f"Generated by `relpos-ablate report` from {runs} finished runs. Each section's tests are "
        f"one family, corrected together ({correction}); an ordering is stated only where the "
        f"adjusted p < 0.05, and a result that is not significant is stated as such, with its "
        f"difference and interval. Two schedules are compared by Welch's t-test over seeds, one "
        f"schedule at two lengths by a paired t-test over its runs; each difference comes with "
        f"its 95% CI; fewer than 3 seeds a side: not tested.\n",
        CLAIMS,
        *text_sections(df, correction),
        *retrieval_sections(df, correction),
    ]
    return "\n".join(parts)


REPORTS = {TEXT: report, (TEXT, RETRIEVAL): report, RETRIEVAL: report}
