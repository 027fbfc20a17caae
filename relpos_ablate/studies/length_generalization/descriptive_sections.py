"""The sections of the length-generalization report that describe without testing: where T5's
far bucket starts against the distances of training and test (`t5_buckets_section`), per task and
variant the runs that reached the threshold, their steps and ID and OOD exact match
(`training_section`), and each variant's rank per task by mean OOD exact match (1 = best, ties share
their mean rank) with its mean rank and mean reciprocal rank over the tasks (`ranking`,
`ranks_section`). A rank orders means; whether two variants differ is tested in orderings.py."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from relpos_ablate.studies.length_generalization.scores import (
    ENCODING,
    counted,
    joined,
    stat,
    variants_in_order,
)


def t5_buckets_section(df: pd.DataFrame) -> list[str]:
    """Where T5's far bucket starts (the model's bucket function, the runs' num_buckets /
    max_distance) against the longest distance in training (train.segment_len - 1) and in the test
    bins."""
    t5 = df[(df[ENCODING] == "t5") & (df["status"] == "done")] if ENCODING in df else df.iloc[0:0]
    fields = ("model.attention.num_buckets", "model.attention.max_distance", "train.segment_len")
    if t5.empty or any(f not in t5 for f in fields):
        return []
    import torch  # only where a T5 run is reported

    from relpos_ablate.model.schemes.tables import far_bucket_start, t5_bucket

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


def training_section(scores: pd.DataFrame, tasks: list[str]) -> list[str]:
    threshold = scores["threshold"].dropna().unique()
    cap = scores["max_steps"].dropna().unique()
    rule = (
        f"a run stopped once held-out in-distribution exact match reached {joined(threshold)} "
        f"(`train.stop_at_exact_match`), else at the cap of {joined(cap, int)} steps; `reached`: "
        f"the runs that stopped at the threshold"
        if len(threshold)
        else f"every run trained max_steps ({joined(cap, int)})"
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
        for variant in variants_in_order(part):
            mine = part[part["variant"] == variant]
            steps = mine["step"].dropna()
            reached = int((mine["stopped"] == "exact_match").sum())
            span = (
                f"{steps.mean():.0f} ({steps.min():.0f}-{steps.max():.0f})" if len(steps) else "-"
            )
            lines.append(
                f"| {task} | {variant} | {reached}/{len(mine)} | {span} | {stat(mine['id'])} | "
                f"{stat(mine['ood'])} |"
            )
    below = scores[scores["id"] < (threshold.min() if len(threshold) else 0.99)]
    lines += [
        "",
        f"Runs below {joined(threshold) if len(threshold) else '0.99'} ID exact match: "
        f"{len(below)} of {len(scores)}"
        + (
            ": "
            + "; ".join(
                f"{t}: {', '.join(counted(below.loc[below['task'] == t, 'variant']))}"
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


def ranking(scores: pd.DataFrame) -> pd.DataFrame:
    """variant x task: the rank of its mean OOD exact match among every variant run (1 = best, ties
    share their mean rank). The one definition behind the rank table and the MRR the trend table
    quotes."""
    return scores.groupby(["task", "variant"])["ood"].mean().unstack("task").rank(ascending=False)


def ranks_section(scores: pd.DataFrame, tasks: list[str]) -> list[str]:
    ranks = ranking(scores)
    variants = [v for v in variants_in_order(scores) if v in ranks.index]
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
