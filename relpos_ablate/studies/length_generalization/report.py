"""The length-generalization study's report (`relpos-ablate report results/length_generalization`,
report.md of `make lengthgen`): every derived number its README quotes, from the collected frame or
the committed summary.csv alike (the studies registry).

Per run (`run_scores`): exact match averaged over its in-distribution bins (ID: n within
data.train_lengths) and over its out-of-distribution bins (OOD: bins that start beyond them),
passkey bins first averaged over their depths; the steps it trained and why it stopped (status.json:
the threshold of train.stop_at_exact_match or the max_steps cap). From those:
- per task and variant: runs that reached the threshold, steps, ID and OOD mean ± std over seeds;
- Kazemnejad et al.'s summary: each variant's rank per task by its mean OOD exact match (1 = best,
  ties share their mean rank) and its mean reciprocal rank over the tasks (their Fig. 1 ranks
  encodings by it); a rank is a description of means, not a tested ordering;
- the trend table of the README: each paper's claim (only what its text says; numbers read off its
  figures are left out) beside the numbers of these runs;
- orderings, one family corrected together (analysis/stats.py; two variants are different models:
  Welch's t-test, each difference with its 95% CI): their abstract's claim, NoPE against each of T5,
  ALiBi, RoPE and sinusoid, then against every other encoding run here, per task and over tasks, and
  randomized against sequential positions for RoPE and ALiBi (Ruoss et al.), ID and OOD. "Over
  tasks" compares the per-seed means over the tasks (seed s's runs of every task, averaged), so each
  side has one value per seed. The trend table quotes the same tests.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from relpos_ablate.analysis.stats import Comparison, Family, listed
from relpos_ablate.config import ConfigError
from relpos_ablate.studies.length_generalization.table import (
    TASK,
    example_rows,
    per_run_bins,
    task_order,
    variant_name,
    variant_order,
)

METRIC = "exact_match"
ENCODING, POSITIONS = "encoding", "model.attention.positions"
THRESHOLD = "train.stop_at_exact_match"
KAZEMNEJAD = ("nope", "t5", "alibi", "rope", "vaswani")
"""Kazemnejad et al.'s five encodings: NoPE, then the explicit ones it is compared with (T5's
relative bias, ALiBi, Rotary, sinusoidal APE). Their abstract's claim, the one tested here: NoPE
outperforms the explicit ones. (Their Fig. 1 ranks all five by mean reciprocal rank; its values are
not in the paper's text.)"""
RANDOMIZED = ("rope", "alibi")
"""Encodings the study trains with randomized positions too."""


def run_scores(df: pd.DataFrame, metric: str = METRIC) -> pd.DataFrame:
    """One row per finished run: task, encoding, positions, seed, step, stopped, max_steps,
    threshold, and its `id` and `ood` mean of `metric` (NaN without such bins)."""
    data = example_rows(df, metric)
    for column in (ENCODING, TASK):
        if column not in data:
            raise ConfigError(
                "report", f"length_generalization needs a {column!r} column (the study's grid axis)"
            )
    bins = per_run_bins(data, metric)
    runs = data.drop_duplicates("run_dir").set_index("run_dir")
    scores = pd.DataFrame(
        {
            "task": runs[TASK],
            "encoding": runs[ENCODING],
            "positions": runs[POSITIONS] if POSITIONS in runs else "sequential",
            "seed": runs["seed"],
            "step": _numbers(runs, "step"),
            "max_steps": _numbers(runs, "max_steps"),
            "stopped": runs["stopped"] if "stopped" in runs else None,
            "threshold": _numbers(runs, THRESHOLD),
            "id": bins[bins["iid"]].groupby("run_dir")[metric].mean(),
            "ood": bins[bins["ood"]].groupby("run_dir")[metric].mean(),
        }
    )
    scores["variant"] = [
        variant_name(e, p) for e, p in zip(scores["encoding"], scores["positions"])
    ]
    scores["order"] = [variant_order(e, p) for e, p in zip(scores["encoding"], scores["positions"])]
    return scores.rename_axis("run_dir").reset_index()


def _numbers(runs: pd.DataFrame, column: str) -> pd.Series | float:
    return pd.to_numeric(runs[column], errors="coerce") if column in runs else math.nan


CAP_EXPERIMENT = "length_generalization_cap"
"""experiments/length_generalization_cap.yaml: the slow learners again with the step cap doubled."""


def length_generalization_report(df: pd.DataFrame, correction: str = "holm") -> str:
    """The study's Markdown (module docstring); with the cap experiment's runs in the frame, its
    section last."""
    if "experiment" in df and (df["experiment"] == CAP_EXPERIMENT).any():
        capped = df[df["experiment"] == CAP_EXPERIMENT]
        main = df[df["experiment"] != CAP_EXPERIMENT]
        return (
            length_generalization_report(main, correction)
            + "\n".join(cap_section(main, capped, correction))
            + "\n"
        )
    scores = run_scores(df)
    family = Family("the orderings (per task and over tasks)", correction)
    # not the spec's: summary.csv alone gives the same report
    tasks = sorted(set(scores["task"]), key=task_order)
    lines = [
        "# Length generalization: derived numbers",
        "",
        f"Generated by `relpos-ablate report` from {len(scores)} finished runs (`{METRIC}` on "
        f"tasks {', '.join(tasks)}). Per run, ID is its mean over the test bins within its "
        f"training lengths and OOD its mean over the bins that start beyond them (passkey: each "
        f"bin first averaged over its depths); cells are mean ± std over seeds (n).",
        "",
    ]
    orderings, over = _orderings(scores, tasks, family)  # first: the trend table quotes its tests
    lines += [
        *_trends(scores, tasks, over),
        *_t5_buckets(df),
        *_training(scores, tasks),
        *_ranks(scores, tasks),
        *listed(orderings),
        family.summary(),
        "",
    ]
    return "\n".join(lines) + "\n"


def _t5_buckets(df: pd.DataFrame) -> list[str]:
    """Where T5's far bucket starts (the model's bucket function, the runs' num_buckets /
    max_distance) against the longest distance in training (train.segment_len - 1) and in the test
    bins."""
    t5 = df[(df[ENCODING] == "t5") & (df["status"] == "done")] if ENCODING in df else df.iloc[0:0]
    fields = ("model.attention.num_buckets", "model.attention.max_distance", "train.segment_len")
    if t5.empty or any(f not in t5 for f in fields):
        return []
    import torch  # only where a T5 run is reported

    from relpos_ablate.model.position.tables import far_bucket_start, t5_bucket

    tested = int(pd.to_numeric(t5["segment_len"], errors="coerce").max()) - 1
    lines = ["## T5's buckets", ""]
    for (buckets, distance, segment), _ in t5.groupby(list(fields)):
        start, trained = far_bucket_start(int(buckets), int(distance)), int(segment) - 1
        bucket = t5_bucket(torch.arange(tested + 1), True, int(buckets), int(distance)).tolist()
        unseen = [
            d for d in range(trained + 1, tested + 1) if bucket[d] not in set(bucket[: trained + 1])
        ]
        verdict = (
            f"training distances reach {trained}, so every bucket a test distance (up to "
            f"{tested}) reads was trained"
            if not unseen
            else f"training distances reach {trained} (buckets up to "
            f"{max(bucket[: trained + 1])}): test distances {unseen[0]}..{unseen[-1]} read "
            f"buckets {bucket[unseen[0]]}..{bucket[unseen[-1]]}, never trained"
        )
        lines.append(
            f"- num_buckets {int(buckets)}, max_distance {int(distance)} (causal): the far bucket "
            f"{int(buckets) - 1} starts at distance {start}; {verdict}."
        )
    return lines + [""]


def cap_section(main: pd.DataFrame, capped: pd.DataFrame, correction: str) -> list[str]:
    """The same task and variants trained again with a higher step cap: runs reaching the threshold,
    steps, ID and OOD at each cap; each variant's ID at the higher cap against the lower one
    (different runs: Welch), and a randomized variant at the higher cap against its sequential twin
    of the main study (whose runs stopped at the threshold long before either cap)."""
    scores, more = run_scores(main), run_scores(capped)
    family = Family("the step cap", correction)
    caps = sorted({int(v) for v in more["max_steps"].dropna()})
    lines = [
        "## The step cap",
        "",
        f"The variants below, on the same task, trained again with the cap at "
        f"{_values(caps, int)} steps (experiments/{CAP_EXPERIMENT}.yaml; the cosine schedule runs "
        f"to the cap, so these are new runs) beside their runs in the study above.",
        "",
        "| task | variant | cap | reached | steps: mean (min-max) | ID | OOD |",
        "|:---|:---|---:|---:|---:|---:|---:|",
    ]
    items = []
    for (task, variant), mine in more.groupby(["task", "variant"], sort=False):
        before = scores[(scores["task"] == task) & (scores["variant"] == variant)]
        for part in (before, mine):
            if part.empty:
                continue
            steps = part["step"].dropna()
            lines.append(
                f"| {task} | {variant} | {_values(part['max_steps'].dropna().unique(), int)} | "
                f"{int((part['stopped'] == 'exact_match').sum())}/{len(part)} | "
                f"{steps.mean():.0f} ({steps.min():.0f}-{steps.max():.0f}) | {_stat(part['id'])} | "
                f"{_stat(part['ood'])} |"
            )
        cap = _values(mine["max_steps"].dropna().unique(), int)
        if not before.empty:
            earlier = _values(before["max_steps"].dropna().unique(), int)
            for measure in ("id", "ood"):
                items.append(
                    (
                        f"{task}, {variant}, {measure.upper()}, cap {cap} vs {earlier}: ",
                        family.compare(
                            f"cap {cap}",
                            _by_run(mine, measure),
                            f"cap {earlier}",
                            _by_run(before, measure),
                            lower_is_better=False,
                            decimals=3,
                        ),
                    )
                )
        encoding = mine["encoding"].iloc[0]
        twin = scores[
            (scores["task"] == task)
            & (scores["encoding"] == encoding)
            & (scores["positions"] == "sequential")
        ]
        if set(mine["positions"]) == {"randomized"} and not twin.empty:
            for measure in ("id", "ood"):
                items.append(
                    (
                        f"{task}, {variant} at cap {cap} vs {twin['variant'].iloc[0]}, "
                        f"{measure.upper()}: ",
                        family.compare(
                            variant,
                            _by_run(mine, measure),
                            twin["variant"].iloc[0],
                            _by_run(twin, measure),
                            lower_is_better=False,
                            decimals=3,
                        ),
                    )
                )
    lines += [
        "",
        "Tests (two sets of runs: Welch's t-test; first minus second, exact match, higher is "
        "better):",
        "",
        *listed(items),
        "",
        family.summary(),
        "",
    ]
    return lines


def _by_run(scores: pd.DataFrame, measure: str) -> dict[str, float]:
    return {
        run: float(v)
        for run, v in zip(scores["run_dir"], scores[measure])
        if not math.isnan(float(v))
    }


def _stat(values) -> str:
    values = [float(v) for v in values if not math.isnan(float(v))]
    if not values:
        return "-"
    std = f" ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else ""
    return f"{np.mean(values):.3f}{std} ({len(values)})"


def _variants(scores: pd.DataFrame) -> list[str]:
    firsts = scores.sort_values("order", kind="stable").drop_duplicates("variant")
    return firsts["variant"].tolist()


def _training(scores: pd.DataFrame, tasks: list[str]) -> list[str]:
    threshold = scores["threshold"].dropna().unique()
    cap = scores["max_steps"].dropna().unique()
    rule = (
        f"a run stopped once held-out in-distribution exact match reached {_values(threshold)} "
        f"(`train.stop_at_exact_match`), else at the cap of {_values(cap, int)} steps; `reached`: "
        f"the runs that stopped at the threshold"
        if len(threshold)
        else f"every run trained max_steps ({_values(cap, int)})"
    )
    lines = [
        "## Training and in-distribution success",
        "",
        f"Steps each run trained: {rule}.",
        "",
        "| task | variant | reached | steps: mean (min-max) | ID | OOD |",
        "|:---|:---|---:|---:|---:|---:|",
    ]
    for task in tasks:
        part = scores[scores["task"] == task]
        for variant in _variants(part):
            mine = part[part["variant"] == variant]
            steps = mine["step"].dropna()
            reached = int((mine["stopped"] == "exact_match").sum())
            span = (
                f"{steps.mean():.0f} ({steps.min():.0f}-{steps.max():.0f})" if len(steps) else "-"
            )
            lines.append(
                f"| {task} | {variant} | {reached}/{len(mine)} | {span} | {_stat(mine['id'])} | "
                f"{_stat(mine['ood'])} |"
            )
    below = scores[scores["id"] < (threshold.min() if len(threshold) else 0.99)]
    lines += [
        "",
        f"Runs below {_values(threshold) if len(threshold) else '0.99'} ID exact match: "
        f"{len(below)} of {len(scores)}"
        + (
            ": "
            + "; ".join(
                f"{t}: {', '.join(_counted(below.loc[below['task'] == t, 'variant']))}"
                for t in tasks
                if t in set(below["task"])
            )
            if len(below)
            else ""
        )
        + ". Their OOD numbers measure a task not learnt at the training lengths as much as "
        "length generalization. (ID here is the test bin; a run stops on its own held-out check, "
        "so one that reached the threshold there can read a little below it here.)",
        "",
    ]
    return lines


def _values(values, kind=float) -> str:
    return ", ".join(f"{kind(v):g}" for v in sorted(values)) or "-"


def _counted(variants: pd.Series) -> list[str]:
    return [f"{name} ({count})" for name, count in variants.value_counts(sort=False).items()]


def _ranking(scores: pd.DataFrame) -> pd.DataFrame:
    """variant x task: the rank of its mean OOD exact match among every variant run (1 = best, ties
    share their mean rank). The one definition behind the rank table and the MRR the trend table
    quotes."""
    return scores.groupby(["task", "variant"])["ood"].mean().unstack("task").rank(ascending=False)


def _ranks(scores: pd.DataFrame, tasks: list[str]) -> list[str]:
    ranks = _ranking(scores)
    variants = [v for v in _variants(scores) if v in ranks.index]
    lines = [
        "## Rank per task and mean reciprocal rank",
        "",
        "Rank of each variant's mean OOD exact match within a task (1 = best; ties share their "
        "mean rank), and over the tasks the mean rank and the mean reciprocal rank (MRR, mean of "
        "1/rank; Kazemnejad et al. summarise their tasks by it). Ranks order means: whether two "
        "variants differ is tested under Orderings.",
        "",
        f"| variant | {' | '.join(tasks)} | mean rank | MRR |",
        "|:---|" + "---:|" * (len(tasks) + 2),
    ]
    for variant in variants:
        row = [ranks.at[variant, t] if t in ranks else math.nan for t in tasks]
        known = [r for r in row if not math.isnan(r)]
        cells = [f"{r:g}" if not math.isnan(r) else "-" for r in row]
        mean = f"{np.mean(known):.2f}" if known else "-"
        mrr = f"{np.mean([1 / r for r in known]):.2f}" if known else "-"
        lines.append(f"| {variant} | {' | '.join(cells)} | {mean} | {mrr} |")
    return [*lines, ""]


Over = dict[tuple, Comparison]
"""(variant a, variant b, id|ood) -> the over-tasks comparison, for the trend table."""


def _orderings(scores: pd.DataFrame, tasks: list[str], family: Family) -> tuple[list, Over]:
    """The lines of the orderings section (text, or (prefix, comparison) read once the family is
    complete) and the over-tasks comparisons by (a, b, column)."""
    lines = [
        "## Orderings",
        "",
        "Each line: the two means and the test (two variants are different models: Welch's t-test "
        "over seeds; higher is better; the difference is the first minus the second, with its 95% "
        "CI).",
        "",
        "NoPE against each encoding run here with sequential positions (OOD exact match): "
        "Kazemnejad et al.'s four first, then the others:",
        "",
    ]
    over: Over = {}
    sequential = scores[scores["positions"] != "randomized"]
    present = set(sequential["encoding"])
    if KAZEMNEJAD[0] in present:
        others = [e for e in KAZEMNEJAD[1:] if e in present] + sorted(
            (e for e in present if e not in KAZEMNEJAD),
            key=lambda e: variant_order(e, "sequential"),
        )
        for other in others:
            lines += _compare(
                sequential,
                ("encoding", KAZEMNEJAD[0]),
                ("encoding", other),
                "ood",
                tasks,
                family,
                over,
            )
    lines += [
        "",
        "Randomized against sequential positions (Ruoss et al.), ID and OOD exact match:",
        "",
    ]
    for encoding in RANDOMIZED:
        mine = scores[scores["encoding"] == encoding]
        if set(mine["positions"]) >= {"sequential", "randomized"}:
            for column in ("id", "ood"):
                lines += _compare(
                    mine,
                    ("positions", "randomized"),
                    ("positions", "sequential"),
                    column,
                    tasks,
                    family,
                    over,
                )
    return [*lines, ""], over


def _compare(
    scores: pd.DataFrame,
    a: tuple[str, str],
    b: tuple[str, str],
    column: str,
    tasks: list[str],
    family: Family,
    over: Over,
) -> list:
    """One line per task and one over the tasks: variant a against variant b on `column` (id or
    ood)."""
    sides, names = _sides(scores, a, b)
    what = "ID" if column == "id" else "OOD"
    lines = []
    for task in tasks:
        samples = [_sample(side[side["task"] == task], column) for side in sides]
        if all(samples):
            lines.append(
                (
                    f"{task}, {what}: ",
                    family.compare(
                        names[0],
                        samples[0],
                        names[1],
                        samples[1],
                        lower_is_better=False,
                        decimals=3,
                    ),
                )
            )
    shared = [t for t in tasks if all(t in set(side["task"]) for side in sides)]
    if len(shared) >= 2:
        samples = [_per_seed(side, column, shared) for side in sides]
        comparison = family.compare(
            names[0], samples[0], names[1], samples[1], lower_is_better=False, decimals=3
        )
        over[(names[0], names[1], column)] = comparison
        lines.append((f"over {', '.join(shared)} (per-seed mean), {what}: ", comparison))
    return lines


def _sides(
    scores: pd.DataFrame, a: tuple[str, str], b: tuple[str, str]
) -> tuple[list[pd.DataFrame], list[str]]:
    sides = [scores[scores[field] == value] for field, value in (a, b)]
    return sides, [
        side["variant"].iloc[0] if len(side) else value for side, (_, value) in zip(sides, (a, b))
    ]


def _sample(runs: pd.DataFrame, column: str) -> dict[str, float]:
    """{run dir: value} of the runs that have one."""
    runs = runs.dropna(subset=[column])
    return dict(zip(runs["run_dir"], runs[column].astype(float)))


def _per_seed(side: pd.DataFrame, column: str, shared: list[str]) -> dict[tuple, float]:
    """Each seed's mean over the `shared` tasks, keyed by the runs it averages (a seed counts where
    it has every one of them, so each task weighs the same)."""
    found = {}
    for _, runs in side[side["task"].isin(shared)].dropna(subset=[column]).groupby("seed"):
        if set(runs["task"]) == set(shared) and len(runs) == len(shared):
            found[tuple(sorted(runs["run_dir"]))] = float(runs[column].mean())
    return found


def _trends(scores: pd.DataFrame, tasks: list[str], over: Over) -> list[str]:
    """The trend table the README quotes: each paper's claim beside what these runs give, every
    number of the right column computed here; the tests are the orderings' over-tasks ones (`over`),
    not run again."""
    rows = []
    fitted = scores.groupby(["task", "variant"])["id"].mean()
    below = [
        f"{variant} on {task} ({value:.3f})"
        for (task, variant), value in fitted.items()
        if value < 0.99
    ]
    rows.append(
        (
            "Kazemnejad et al.: in most tasks every model is perfect or nearly so at the training "
            "lengths (their Section 4, Fig. 3)",
            f"{len(fitted) - len(below)} of {len(fitted)} (task, variant) pairs reach a mean ID "
            f"exact match of 0.99" + (f"; below it: {'; '.join(below)}" if below else ""),
        )
    )
    reciprocal = (1 / _ranking(scores)).mean(axis=1)  # over the tasks each variant has
    five = [e for e in KAZEMNEJAD if variant_name(e) in reciprocal.index]
    if five:
        ours = ", ".join(
            f"{variant_name(e)} {reciprocal[variant_name(e)]:.2f}"
            for e in sorted(five, key=lambda e: -reciprocal[variant_name(e)])
        )
        nope = KAZEMNEJAD[0]
        tested = [
            f"{variant_name(nope)} vs {variant_name(y)}: {comparison}"
            for y in five
            if y != nope
            if (comparison := over.get((variant_name(nope), variant_name(y), "ood")))
        ]
        rows.append(
            (
                "Kazemnejad et al.: NoPE outperforms the explicit encodings (T5's relative bias, "
                "ALiBi, Rotary, APE), and ALiBi, Rotary and APE are not well suited for length "
                "generalization (abstract); their Fig. 1 ranks the five by mean reciprocal rank "
                "over their tasks",
                f"MRR of these over {', '.join(tasks)} (ranks among all {len(reciprocal)} "
                f"variants run here, as in the rank table): {ours}. Over the tasks (per-seed mean "
                f"OOD): " + "; ".join(tested),
            )
        )
    for encoding in RANDOMIZED:
        mine = scores[scores["encoding"] == encoding]
        if set(mine["positions"]) >= {"sequential", "randomized"}:
            names = _sides(mine, ("positions", "randomized"), ("positions", "sequential"))[1]
            ood, iid = (over.get((*names, column)) for column in ("ood", "id"))
            rows.append(
                (
                    f"Ruoss et al.: randomized positions raise test accuracy on longer inputs, by "
                    f"12.0% on average over 15 tasks (abstract), and leave in-domain accuracy "
                    f"unaffected (Section 1); {variant_name(encoding)}",
                    f"OOD {ood or '-'}; ID {iid or '-'}",
                )
            )
    return [
        "## Trends: the papers' and ours",
        "",
        "| trend in the paper | these runs |",
        "|---|---|",
        *(f"| {claim} | {ours} |" for claim, ours in rows),
        "",
    ]
