"""The aggregate over cells (relpos_ablate/analysis/aggregate.py): the IQM against an explicit sort
and trim and scipy, the probability of improvement against a double loop over pairs and scipy's
Mann-Whitney U, the stratified bootstrap against a reference loop written here (resamples stay in
their cell, the seed fixes them, the interval is numpy's percentile of the replicates, coverage),
the Aggregate's intervals and sentence, the data-frame entry point, and the one-line errors.

Run: .venv/bin/python -m pytest tests/analysis/test_aggregate.py -q
"""

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sp

from relpos_ablate.analysis.aggregate import (
    Aggregate,
    aggregate,
    aggregate_pair,
    bootstrap_replicates,
    iqm,
    probability_of_improvement,
    stratified_bootstrap_ci,
)
from relpos_ablate.config import ConfigError

REPS = 300


def _reference_resamples(*arrays, reps, seed):
    """The documented protocol, one index at a time: per array, one draw of [reps, runs, cells]
    indices; resample r takes run idx[r, i, t] of cell t into [i, t]."""
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, a.shape[0], size=(reps, *a.shape)) for a in arrays]
    resamples = []
    for r in range(reps):
        resampled = []
        for a, idx in zip(arrays, draws):
            runs, cells = a.shape
            resampled.append(
                np.array([[a[idx[r, i, t], t] for t in range(cells)] for i in range(runs)])
            )
        resamples.append(resampled)
    return resamples


def _replicates(fn, resamples):
    return np.array([fn(*resampled) for resampled in resamples])


def _pairs_probability(x, y):
    """P(X > Y) by brute force: every pair of runs per cell, ties 1/2, averaged over cells."""
    per_cell = []
    for t in range(x.shape[1]):
        wins = 0.0
        for xi in x[:, t]:
            for yj in y[:, t]:
                wins += 1.0 if xi > yj else 0.5 if xi == yj else 0.0
        per_cell.append(wins / (x.shape[0] * y.shape[0]))
    return sum(per_cell) / len(per_cell)


def _scores(rng, runs, cells, shift=0.0):
    return rng.normal(loc=np.linspace(0, 1, cells) + shift, scale=0.3, size=(runs, cells))


# --- IQM ---


def test_iqm_is_the_mean_of_the_middle_half():
    assert iqm(np.arange(1, 9)) == pytest.approx((3 + 4 + 5 + 6) / 4)
    assert iqm(np.arange(1, 9).reshape(4, 2)) == pytest.approx(4.5)
    scores = np.array([[9.0, -3.0], [0.5, 100.0], [2.0, 2.0], [7.0, 1.5]])  # (4 runs, 2 cells)
    flat = sorted(scores.ravel())
    cut = len(flat) // 4
    assert iqm(scores) == pytest.approx(sum(flat[cut:-cut]) / (len(flat) - 2 * cut))
    rng = np.random.default_rng(1)
    for n in range(1, 14):  # every remainder of n / 4
        other = rng.normal(size=(n, 3))
        assert iqm(other) == pytest.approx(sp.trim_mean(other, 0.25, axis=None))


def test_iqm_ignores_outlying_runs():
    scores = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    wild = scores.copy()
    wild[0, 0], wild[1, 1] = -1e6, 1e6
    assert iqm(wild) == pytest.approx(iqm(scores))


# --- probability of improvement ---


def test_probability_of_improvement_counts_pairs():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 4, size=(4, 3)).astype(float)  # small integers: many ties
    y = rng.integers(0, 4, size=(6, 3)).astype(float)
    assert probability_of_improvement(x, y) == pytest.approx(_pairs_probability(x, y))
    mann_whitney = [
        sp.mannwhitneyu(x[:, t], y[:, t], alternative="greater").statistic / (4 * 6)
        for t in range(3)
    ]
    assert probability_of_improvement(x, y) == pytest.approx(np.mean(mann_whitney))


def test_probability_of_improvement_known_values_and_direction():
    low = np.array([[0.0, 1.0], [0.5, 1.5]])
    assert probability_of_improvement(low + 10, low) == 1.0
    assert probability_of_improvement(low, low + 10) == 0.0
    assert probability_of_improvement(low, low) == 0.5
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(5, 4)).round(1), rng.normal(size=(3, 4)).round(1)
    higher = probability_of_improvement(x, y)
    lower = probability_of_improvement(x, y, lower_is_better=True)
    assert lower == pytest.approx(1 - higher)
    assert lower == pytest.approx(_pairs_probability(y, x))
    assert lower == pytest.approx(_pairs_probability(-x, -y))


# --- stratified bootstrap ---


def test_resamples_stay_within_their_cell():
    rng = np.random.default_rng(4)
    offsets = np.array([0.0, 100.0, -50.0, 7.0])
    scores = offsets + rng.uniform(0, 1, size=(5, 4))  # (runs, cells): each cell its own range
    means = bootstrap_replicates(lambda s: s.mean(axis=0), scores, reps=REPS, seed=0)
    assert means.shape == (REPS, 4)
    assert np.all(means >= scores.min(axis=0) - 1e-12)
    assert np.all(means <= scores.max(axis=0) + 1e-12)
    # every resampled value is one of its own cell's runs
    values = bootstrap_replicates(lambda s: s.ravel(), scores, reps=50, seed=1).reshape(50, 5, 4)
    for t in range(4):
        assert set(np.unique(values[:, :, t])) <= set(scores[:, t])


def test_bootstrap_matches_the_reference_loop_and_is_seeded():
    rng = np.random.default_rng(5)
    a, b = _scores(rng, 3, 6, 0.2), _scores(rng, 5, 6)

    def difference(x, y):
        return iqm(x) - iqm(y)

    reference = _replicates(difference, _reference_resamples(a, b, reps=REPS, seed=11))
    replicates = bootstrap_replicates(difference, a, b, reps=REPS, seed=11)
    np.testing.assert_allclose(replicates, reference)
    point, (lo, hi) = stratified_bootstrap_ci(difference, a, b, reps=REPS, seed=11)
    assert point == pytest.approx(iqm(a) - iqm(b))
    assert (lo, hi) == pytest.approx(tuple(np.percentile(reference, [2.5, 97.5])))
    assert lo <= point <= hi
    narrow = stratified_bootstrap_ci(difference, a, b, reps=REPS, confidence=0.5, seed=11)[1]
    assert narrow == pytest.approx(tuple(np.percentile(reference, [25, 75])))
    again = stratified_bootstrap_ci(difference, a, b, reps=REPS, seed=11)
    other = stratified_bootstrap_ci(difference, a, b, reps=REPS, seed=12)
    assert again == (point, (lo, hi))
    assert other[1] != (lo, hi)


def test_interval_of_the_mean_covers_the_true_mean():
    rng = np.random.default_rng(6)
    true_mean, covered, repeats = 1.5, 0, 200
    for _ in range(repeats):
        scores = rng.normal(true_mean, 1.0, size=(20, 3))
        lo, hi = stratified_bootstrap_ci(np.mean, scores, reps=200, seed=int(rng.integers(1e9)))[1]
        covered += lo <= true_mean <= hi
    assert 0.88 <= covered / repeats <= 0.99


# --- Aggregate ---


def test_aggregate_intervals_come_from_the_same_resamples():
    rng = np.random.default_rng(7)
    a, b = _scores(rng, 3, 8, 0.3), _scores(rng, 4, 8)
    result = aggregate("alibi", a, "nope", b, reps=REPS, seed=3)
    resamples = _reference_resamples(a, b, reps=REPS, seed=3)
    for statistic, point, ci in [
        (lambda x, y: iqm(x), result.iqm_a, result.iqm_a_ci),
        (lambda x, y: iqm(y), result.iqm_b, result.iqm_b_ci),
        (lambda x, y: iqm(x) - iqm(y), result.difference, result.difference_ci),
        (probability_of_improvement, result.p_improvement, result.p_improvement_ci),
    ]:
        reference = _replicates(statistic, resamples)
        assert point == pytest.approx(statistic(a, b))
        assert ci == pytest.approx(tuple(np.percentile(reference, [2.5, 97.5])))
        assert ci[0] <= point <= ci[1]
    assert (result.runs_a, result.runs_b, result.cells, result.reps) == (3, 4, 8, REPS)
    flipped = aggregate("alibi", a, "nope", b, lower_is_better=True, reps=REPS, seed=3)
    assert flipped.p_improvement == pytest.approx(1 - result.p_improvement)
    assert flipped.difference == result.difference


def test_sentence_states_the_numbers_it_holds():
    held = Aggregate(
        name_a="alibi",
        name_b="nope",
        iqm_a=0.812,
        iqm_a_ci=(0.771, 0.853),
        iqm_b=0.641,
        iqm_b_ci=(0.602, 0.688),
        difference=0.171,
        difference_ci=(0.112, 0.229),
        p_improvement=0.834,
        p_improvement_ci=(0.741, 0.912),
        runs_a=3,
        runs_b=3,
        cells=12,
        reps=2000,
    )
    assert str(held) == (
        "alibi vs nope over 12 cells (3 seeds each): IQM 0.81 [0.77, 0.85] vs 0.64 [0.60, 0.69]; "
        "difference 0.17, 95% CI [0.11, 0.23]; P(alibi > nope) = 0.83, 95% CI [0.74, 0.91] "
        "(stratified bootstrap, 2000 resamples)"
    )
    # a bound that rounds to 0 keeps its sign: an interval [-0.0034, 0.13] does not read as
    # excluding 0
    near = dataclasses.replace(held, difference=0.004, difference_ci=(-0.0034, 0.13))
    assert "difference 0.004, 95% CI [-0.003, 0.13]" in str(near)
    rng = np.random.default_rng(8)
    result = aggregate(
        "fire", _scores(rng, 2, 5), "rope", _scores(rng, 4, 5), lower_is_better=True, reps=REPS
    )
    text = result.said(decimals=3)
    numbers = [result.iqm_a, *result.iqm_a_ci, result.iqm_b, *result.iqm_b_ci, result.difference]
    for number in [*numbers, *result.difference_ci]:
        assert f"{number:.3f}" in text
    for number in [result.p_improvement, *result.p_improvement_ci]:
        assert f"{number:.2f}" in text
    assert "P(fire < rope)" in text and "(2 and 4 seeds)" in text and f"{REPS} resamples" in text


# --- from data frames ---


def _frame(scores, cells, rng):
    """One row per (cell, seed), rows shuffled; cell t of the array is cells[t]."""
    rows = [
        {"task": task, "length": length, "seed": seed, "loss": scores[seed, t]}
        for t, (task, length) in enumerate(cells)
        for seed in range(scores.shape[0])
    ]
    return pd.DataFrame(rows).sample(frac=1, random_state=int(rng.integers(1000)))


def test_aggregate_pair_pivots_frames_to_the_arrays():
    rng = np.random.default_rng(9)
    cells = sorted([("copy", 64), ("copy", 128), ("sort", 64), ("sort", 128)])
    a, b = _scores(rng, 3, 4), _scores(rng, 2, 4, 0.4)
    from_frames = aggregate_pair(
        _frame(a, cells, rng),
        _frame(b, cells, rng),
        ["task", "length"],
        "loss",
        "alibi",
        "nope",
        lower_is_better=True,
        reps=REPS,
        seed=5,
    )
    from_arrays = aggregate("alibi", a, "nope", b, lower_is_better=True, reps=REPS, seed=5)
    assert from_frames == from_arrays


def test_aggregate_pair_names_the_cells_that_do_not_match():
    rng = np.random.default_rng(10)
    cells = [("copy", 64), ("copy", 128), ("sort", 64)]
    a = _frame(_scores(rng, 3, 3), cells, rng)
    b = _frame(_scores(rng, 3, 2), cells[:2], rng)
    with pytest.raises(ConfigError, match=r"^aggregate: only alibi has \(sort, 64\);") as err:
        aggregate_pair(a, b, ["task", "length"], "loss", "alibi", "nope", reps=REPS)
    assert "\n" not in str(err.value)
    ragged = a[~((a["task"] == "copy") & (a["length"] == 128) & (a["seed"] == 2))]
    uneven = r"alibi has 3 seeds in most cells but 2 in \(copy, 128\); every cell needs the same"
    with pytest.raises(ConfigError, match=uneven):
        aggregate_pair(ragged, a, ["task", "length"], "loss", "alibi", "nope", reps=REPS)
    holed = a.copy()
    holed.loc[(holed["task"] == "sort") & (holed["seed"] == 0), "loss"] = math.nan
    with pytest.raises(ConfigError, match=r"nope has NaN or infinite 'loss' in cell \(sort, 64\)"):
        aggregate_pair(a, holed, ["task", "length"], "loss", "alibi", "nope", reps=REPS)
    with pytest.raises(ConfigError, match=r"alibi has several rows for one seed"):
        aggregate_pair(pd.concat([a, a]), a, ["task", "length"], "loss", "alibi", "nope")
    with pytest.raises(ConfigError, match=r"nope has no column ppl"):
        aggregate_pair(a.assign(ppl=1.0), a, ["task", "length"], "ppl", "alibi", "nope")
    with pytest.raises(ConfigError, match=r"alibi: 'task' holds values that are not numbers"):
        aggregate_pair(a, a, ["length"], "task", "alibi", "nope")
    with pytest.raises(ConfigError, match=r"alibi has no rows"):
        aggregate_pair(a.iloc[:0], a, ["task", "length"], "loss", "alibi", "nope")
    single = a[a["seed"] == 0]
    with pytest.raises(ConfigError, match=r"alibi has 1 seed per cell; .* at least 2"):
        aggregate_pair(single, a, ["task", "length"], "loss", "alibi", "nope")


# --- errors ---


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: iqm([]), r"^scores: empty"),
        (lambda: iqm([1.0, math.nan, 2.0]), r"^scores: NaN or infinite score at index \(1,\)"),
        (lambda: iqm(["a", "b"]), r"^scores: scores must be numbers"),
        (lambda: probability_of_improvement(np.ones(3), np.ones((3, 1))), r"^x: expected .*\(3,\)"),
        (
            lambda: probability_of_improvement(np.ones((3, 2)), np.ones((3, 4))),
            r"^y: 4 cells but x has 2",
        ),
        (
            lambda: stratified_bootstrap_ci(np.mean, np.ones((1, 4))),
            r"^score_arrays\[0\]: 1 run per cell; .* at least 2",
        ),
        (lambda: stratified_bootstrap_ci(np.mean), r"^score_arrays: no scores given"),
        (lambda: stratified_bootstrap_ci(np.mean, np.ones((3, 2)), reps=0), r"^reps: .* >= 1"),
        (
            lambda: stratified_bootstrap_ci(np.mean, np.ones((3, 2)), confidence=95),
            r"^confidence: .* between 0 and 1",
        ),
        (
            lambda: stratified_bootstrap_ci(lambda s: s.mean(axis=0), np.ones((3, 2))),
            r"^fn: must return one number",
        ),
        (lambda: aggregate("a", np.ones((3, 2)), "b", np.ones((3, 5))), r"^scores_b: 5 cells"),
        (
            lambda: aggregate("a", np.full((3, 2), math.inf), "b", np.ones((3, 2))),
            r"^scores_a: NaN or infinite score at index \(0, 0\), \(0, 1\), \(1, 0\) and 3 more",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_field(call, message):
    with pytest.raises(ConfigError, match=message) as err:
        call()
    assert "\n" not in str(err.value)
