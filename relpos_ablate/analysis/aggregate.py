"""One headline interval for a comparison over many cells (tasks x lengths), with the estimators of
Agarwal et al., "Deep RL at the Edge of the Statistical Precipice" (NeurIPS 2021). Their library,
rliable, sets the conventions followed here; it is not a dependency.

- **Scores** are an array [runs, cells] per model: row i is one run (a seed), column t one cell (a
  task at a length). Runs are not matched across cells or across models: the bootstrap resamples
  each cell's runs on their own, and the two models may have different numbers of runs.
- `iqm`: the interquartile mean, the mean of the middle half of all runs x cells taken together
  (`scipy.stats.trim_mean(scores, 0.25, axis=None)`, rliable's `aggregate_iqm`). A few outlying
  runs do not move it, and it is less noisy than the median.
- `probability_of_improvement`: P(X > Y) = (1/T) Σ_t (1/(m n)) Σ_i Σ_j ([x_it > y_jt] +
  ½ [x_it = y_jt]): per cell the Mann-Whitney U of X's m runs against Y's n runs over m n, averaged
  over the T cells (rliable's definition). 0.5 is "no better, no worse".
- `stratified_bootstrap_ci`: the percentile interval of a statistic over resamples that draw each
  cell's runs with replacement from that cell only (stratified by cell), each model independently.
- `aggregate` (arrays) and `aggregate_pair` (data frames with one row per cell and seed): two
  models' IQMs, their difference and P(a better than b), each with its interval from the same
  resamples, as an `Aggregate` that states them in one sentence.

The intervals cover the uncertainty of the seeds on these cells; the cells are fixed, not a sample
from a population of tasks (rliable's `task_bootstrap=False`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from relpos_ablate.config import ConfigError

MIN_RUNS = 2
"""A cell needs at least this many runs a side to be resampled (one run resamples to itself)."""
REPS = 2000
"""Bootstrap resamples by default (rliable's default is 50,000): with 2000, the level each end of a
95% interval sits at is off by about 0.35 percentile points (one standard error of the 2.5%
quantile, sqrt(0.025 * 0.975 / 2000))."""
CONFIDENCE = 0.95


def _scores(field: str, scores, *, matrix: bool = True, min_runs: int = 1) -> np.ndarray:
    """The scores as a float array, or a one-line ConfigError naming `field`: numbers, [runs, cells]
    when `matrix`, non-empty, at least `min_runs` runs, no NaN or infinity."""
    try:
        array = np.asarray(scores, dtype=float)
    except (TypeError, ValueError):
        raise ConfigError(field, "scores must be numbers, an array [runs, cells]") from None
    if matrix and array.ndim != 2:
        raise ConfigError(field, f"expected an array [runs, cells]; got shape {array.shape}")
    if array.size == 0:
        raise ConfigError(field, f"empty (shape {array.shape}); give one run of one cell at least")
    if matrix and array.shape[0] < min_runs:
        raise ConfigError(
            field,
            f"{array.shape[0]} run per cell; the bootstrap needs at least {min_runs} to resample",
        )
    bad = np.argwhere(~np.isfinite(array))
    if len(bad):
        where = ", ".join(str(tuple(int(i) for i in index)) for index in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ConfigError(
            field, f"NaN or infinite score at index {where}{more}; drop or fill those runs first"
        )
    return array


def _check_reps(reps: int) -> None:
    if not (isinstance(reps, (int, np.integer)) and reps >= 1):
        raise ConfigError("reps", f"the number of resamples must be an integer >= 1; got {reps!r}")


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ConfigError("confidence", f"must lie strictly between 0 and 1; got {confidence!r}")


def iqm(scores) -> float:
    """IQM = the mean of the scores left after cutting ⌊N/4⌋ of the N values (all runs x cells,
    flattened) from each end: `scipy.stats.trim_mean(scores, 0.25, axis=None)`."""
    flat = np.sort(_scores("scores", scores, matrix=False), axis=None)
    cut = len(flat) // 4
    # trim_mean's own cut, written out: scipy's call costs ~0.1 ms, paid once per resample
    return float(flat[cut : len(flat) - cut].mean())


def probability_of_improvement(x, y, lower_is_better: bool = False) -> float:
    """P(X > Y) = (1/T) Σ_t (1/(m n)) Σ_i Σ_j ([x_it > y_jt] + ½ [x_it = y_jt]) for x [m, T] and
    y [n, T] (module docstring); with `lower_is_better`, P(X < Y): the same on -x and -y."""
    x, y = _scores("x", x), _scores("y", y)
    if x.shape[1] != y.shape[1]:
        raise ConfigError(
            "y", f"{y.shape[1]} cells but x has {x.shape[1]}; both need the same cells in order"
        )
    if lower_is_better:
        x, y = -x, -y
    pairs_x, pairs_y = x[:, None, :], y[None, :, :]  # (m, 1, T) against (1, n, T): every pair
    wins = (pairs_x > pairs_y) + 0.5 * (pairs_x == pairs_y)  # (m, n, T)
    return float(wins.mean(axis=(0, 1)).mean())


def bootstrap_replicates(
    fn: Callable[..., float], *score_arrays, reps: int = REPS, seed: int = 0
) -> np.ndarray:
    """`fn(*resampled)` over `reps` stratified resamples: [reps] for an fn that returns a number,
    [reps, k] for one that returns k numbers.

    The protocol is fixed, so a seed names one set of resamples: rng =
    `numpy.random.default_rng(seed)`; for each array in the order given (m runs, T cells), one draw
    idx = `rng.integers(0, m, size=(reps, m, T))`, and resample r holds array[idx[r, i, t], t] at
    [i, t]: cell t's runs come from cell t only, each array is drawn independently."""
    if not score_arrays:
        raise ConfigError("score_arrays", "no scores given; pass one array [runs, cells] per model")
    _check_reps(reps)
    arrays = [
        _scores(f"score_arrays[{k}]", scores, min_runs=MIN_RUNS)
        for k, scores in enumerate(score_arrays)
    ]
    rng = np.random.default_rng(seed)
    resampled = [
        array[rng.integers(0, array.shape[0], size=(reps, *array.shape)), np.arange(array.shape[1])]
        for array in arrays
    ]  # each (reps, m, T)
    return np.asarray([fn(*(r[k] for r in resampled)) for k in range(reps)], dtype=float)


def _percentile_interval(replicates: np.ndarray, confidence: float) -> np.ndarray:
    """[lo, hi] (along the first axis): the (1 - c)/2 and (1 + c)/2 quantiles of the replicates
    (rliable's default method, 'percentile'; numpy's linear interpolation)."""
    return np.percentile(replicates, [50 * (1 - confidence), 50 * (1 + confidence)], axis=0)


def stratified_bootstrap_ci(
    fn: Callable[..., float],
    *score_arrays,
    reps: int = REPS,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float, tuple[float, float]]:
    """(fn(*score_arrays), (lo, hi)): the point estimate on the data and the percentile interval of
    fn over `bootstrap_replicates` (each cell's runs resampled within the cell, each array on its
    own; deterministic for a seed)."""
    _check_confidence(confidence)
    replicates = bootstrap_replicates(fn, *score_arrays, reps=reps, seed=seed)
    if replicates.ndim != 1:
        raise ConfigError("fn", "must return one number; use bootstrap_replicates for several")
    lo, hi = _percentile_interval(replicates, confidence)
    return float(fn(*(np.asarray(s, dtype=float) for s in score_arrays))), (float(lo), float(hi))


@dataclass(frozen=True)
class Aggregate:
    """Two models compared over the same cells: each IQM, their difference and P(a better than b),
    each with its bootstrap interval (all four from the same resamples)."""

    name_a: str
    name_b: str
    iqm_a: float
    iqm_a_ci: tuple[float, float]
    iqm_b: float
    iqm_b_ci: tuple[float, float]
    difference: float
    """iqm_a - iqm_b, whichever direction is better."""
    difference_ci: tuple[float, float]
    p_improvement: float
    """P(a > b) per cell, averaged over cells; P(a < b) when lower_is_better."""
    p_improvement_ci: tuple[float, float]
    runs_a: int
    runs_b: int
    cells: int
    reps: int
    confidence: float = CONFIDENCE
    lower_is_better: bool = False

    def said(self, decimals: int = 2) -> str:
        """`alibi vs nope over 12 cells (3 seeds each): IQM 0.81 [0.77, 0.85] vs 0.64 [0.60, 0.69];
        difference 0.17, 95% CI [0.11, 0.23]; P(alibi > nope) = 0.83, 95% CI [0.74, 0.91]
        (stratified bootstrap, 2000 resamples)`."""

        def num(x: float) -> str:
            text = f"{x:.{decimals}f}"
            # a value that rounds to 0 keeps its sign and first digit (-0.003, not -0.00 or 0.00)
            return text if float(text) != 0 or x == 0 else f"{x:.1g}"

        def interval(ci: tuple[float, float]) -> str:
            return f"[{num(ci[0])}, {num(ci[1])}]"

        level = f"{self.confidence * 100:g}%"
        seeds = (
            f"{self.runs_a} seeds each"
            if self.runs_a == self.runs_b
            else f"{self.runs_a} and {self.runs_b} seeds"
        )
        better = "<" if self.lower_is_better else ">"
        return (
            f"{self.name_a} vs {self.name_b} over {self.cells} cell{'s' * (self.cells != 1)} "
            f"({seeds}): IQM {num(self.iqm_a)} {interval(self.iqm_a_ci)} vs {num(self.iqm_b)} "
            f"{interval(self.iqm_b_ci)}; difference {num(self.difference)}, {level} CI "
            f"{interval(self.difference_ci)}; P({self.name_a} {better} {self.name_b}) = "
            f"{self.p_improvement:.2f}, {level} CI [{self.p_improvement_ci[0]:.2f}, "
            f"{self.p_improvement_ci[1]:.2f}] (stratified bootstrap, {self.reps} resamples)"
        )

    def __str__(self) -> str:
        return self.said()


def aggregate(
    name_a: str,
    scores_a,
    name_b: str,
    scores_b,
    *,
    lower_is_better: bool = False,
    reps: int = REPS,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Aggregate:
    """The `Aggregate` of a [runs_a, cells] against b [runs_b, cells] (the same cells, in the same
    column order): one `bootstrap_replicates` of (IQM(a), IQM(b), IQM(a) - IQM(b), P(a better
    than b)), so each interval is what `stratified_bootstrap_ci` gives for that statistic of (a, b)
    with the same seed."""
    a = _scores("scores_a", scores_a, min_runs=MIN_RUNS)
    b = _scores("scores_b", scores_b, min_runs=MIN_RUNS)
    if a.shape[1] != b.shape[1]:
        raise ConfigError(
            "scores_b", f"{b.shape[1]} cells but scores_a has {a.shape[1]}; compare the same cells"
        )
    _check_confidence(confidence)

    def statistics(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
        iqm_x, iqm_y = iqm(x), iqm(y)
        return iqm_x, iqm_y, iqm_x - iqm_y, probability_of_improvement(x, y, lower_is_better)

    point = statistics(a, b)
    replicates = bootstrap_replicates(statistics, a, b, reps=reps, seed=seed)  # (reps, 4)
    lo, hi = _percentile_interval(replicates, confidence)
    ci = [(float(low), float(high)) for low, high in zip(lo, hi)]
    return Aggregate(
        name_a=name_a,
        name_b=name_b,
        iqm_a=point[0],
        iqm_a_ci=ci[0],
        iqm_b=point[1],
        iqm_b_ci=ci[1],
        difference=point[2],
        difference_ci=ci[2],
        p_improvement=point[3],
        p_improvement_ci=ci[3],
        runs_a=a.shape[0],
        runs_b=b.shape[0],
        cells=a.shape[1],
        reps=int(reps),
        confidence=confidence,
        lower_is_better=lower_is_better,
    )


def _cell(key: tuple) -> str:
    return str(key[0]) if len(key) == 1 else f"({', '.join(map(str, key))})"


def _listed(keys, most: int = 5) -> str:
    keys = list(keys)
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(_cell(k) for k in keys[:most]) + more


def _cells(frame: pd.DataFrame, name: str, cells: list[str], value: str, run: str) -> dict:
    """cell key (a tuple) -> that cell's values in `run` order, or a one-line error naming the
    side."""
    missing = [c for c in dict.fromkeys([*cells, run, value]) if c not in frame.columns]
    if missing:
        raise ConfigError(
            "aggregate", f"{name} has no column {', '.join(missing)}; it has {list(frame.columns)}"
        )
    if frame.empty:
        raise ConfigError("aggregate", f"{name} has no rows")
    try:
        values = frame[value].to_numpy(dtype=float)
    except (TypeError, ValueError):
        message = f"{name}: {value!r} holds values that are not numbers"
        raise ConfigError("aggregate", message) from None
    keys = [tuple(k) for k in frame[cells].itertuples(index=False)]
    twice = frame.duplicated([*cells, run], keep=False).to_numpy()
    if twice.any():
        where = _listed(dict.fromkeys(k for k, t in zip(keys, twice) if t))
        raise ConfigError("aggregate", f"{name} has several rows for one {run} in cell {where}")
    nan = ~np.isfinite(values)
    if nan.any():
        where = _listed(dict.fromkeys(k for k, n in zip(keys, nan) if n))
        raise ConfigError("aggregate", f"{name} has NaN or infinite {value!r} in cell {where}")
    grid: dict[tuple, list[tuple]] = {}
    for key, run_id, v in zip(keys, frame[run], values):
        grid.setdefault(key, []).append((run_id, v))
    return {key: np.array([v for _, v in sorted(pairs)]) for key, pairs in grid.items()}


def _runs_by_cell(grid: dict, keys: list, name: str, run: str) -> np.ndarray:
    """[runs, cells] with the cells in `keys` order; every cell needs the same number of runs."""
    counts = {key: len(grid[key]) for key in keys}
    usual = Counter(counts.values()).most_common(1)[0][0]
    odd = [key for key in keys if counts[key] != usual]
    if odd:
        raise ConfigError(
            "aggregate",
            f"{name} has {usual} {run}s in most cells but "
            f"{'/'.join(str(n) for n in sorted({counts[k] for k in odd}))} in {_listed(odd)}; "
            f"every cell needs the same number of {run}s",
        )
    if usual < MIN_RUNS:
        raise ConfigError(
            "aggregate",
            f"{name} has {usual} {run} per cell; the bootstrap needs at least {MIN_RUNS}",
        )
    return np.stack([grid[key] for key in keys], axis=1)  # (runs, cells)


def aggregate_pair(
    a: pd.DataFrame,
    b: pd.DataFrame,
    cells: Sequence[str],
    value: str,
    name_a: str = "a",
    name_b: str = "b",
    *,
    run: str = "seed",
    lower_is_better: bool = False,
    reps: int = REPS,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> Aggregate:
    """The `Aggregate` of two models from data frames with one row per (cell, run): the columns
    `cells` name a cell (e.g. ["task", "length"]), `run` the run within it, `value` its score.

    Both sides need the same cells, and on each side every cell the same number of runs (the two
    sides may differ); otherwise a one-line ConfigError names the cells. The arrays passed to
    `aggregate` hold the cells in sorted key order as columns and each cell's runs in sorted `run`
    order as rows (only the resamples a seed picks depend on that order)."""
    cells = list(cells)
    grid_a = _cells(a, name_a, cells, value, run)
    grid_b = _cells(b, name_b, cells, value, run)
    only_a, only_b = sorted(grid_a.keys() - grid_b.keys()), sorted(grid_b.keys() - grid_a.keys())
    if only_a or only_b:
        sides = [
            f"only {name} has {_listed(keys)}"
            for name, keys in ((name_a, only_a), (name_b, only_b))
            if keys
        ]
        raise ConfigError(
            "aggregate", f"{'; '.join(sides)}; both sides need the same cells ({', '.join(cells)})"
        )
    keys = sorted(grid_a)
    return aggregate(
        name_a,
        _runs_by_cell(grid_a, keys, name_a, run),
        name_b,
        _runs_by_cell(grid_b, keys, name_b, run),
        lower_is_better=lower_is_better,
        reps=reps,
        confidence=confidence,
        seed=seed,
    )
