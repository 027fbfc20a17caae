"""RECL, the Relative Effective Context Length of Transformer-XL (Dai et al. 2019, §4.3 and App. C), for a
group of models, from per-token losses at a ladder of context lengths (docs/formulas.md#recl).

For each context c of the ladder, l_i(c, t) is model i's loss on target t with exactly c tokens of
context (runs evaluate it with `eval.recl_contexts`: sliding windows of c tokens, stride 1, saving
every target's loss). With b(c, t) = min_i l_i(c, t) the group's best loss and T the top-r fraction of
targets by b(c, t) (re-chosen for every c):

    f_i(c, c') = mean over t in T of min(b(c, t), l_i(c', t))
    g_i(c, c') = (exp f_i(c, c) - exp f_i(c, c')) / exp f_i(c, c)

Starting at the ladder's first c with c' the next one, RECL_i is the first c whose gain g_i(c, c')
falls below the threshold (1%); c then steps to c'. A model still gaining at the last step gets the
last context, marked as a lower bound (censored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from relpos_ablate import rundir
from relpos_ablate.config import ConfigError

R_VALUES = (0.1, 0.5, 1.0)
"""The fractions of hardest targets Table 8 reports."""
THRESHOLD = 0.01
"""The paper's threshold on the relative gain g (1%)."""


@dataclass(frozen=True)
class Recl:
    """One model's RECL: the context found, and whether the search ran off the end of the ladder."""

    context: int
    censored: bool = False
    """True when the gain was still above the threshold at the last step: RECL >= context."""


def top_fraction(values: np.ndarray, r: float) -> np.ndarray:
    """Indices of the round(r·n) largest values (at least one; ties: the earlier target first)."""
    k = max(1, math.floor(r * len(values) + 0.5))
    return np.argsort(-values, kind="stable")[:k]


def relative_gain(losses: np.ndarray, i: int, short: int, long: int, r: float) -> float:
    """g_i(c, c') for model i between ladder steps short (c) and long (c'); losses [models, contexts, targets]."""
    baseline = losses[:, short].min(0)  # b(c, t): the group's best loss at context c
    hardest = top_fraction(baseline, r)  # T, chosen again for every c
    f_short = np.minimum(baseline[hardest], losses[i, short, hardest]).mean()  # = mean b(c, t): b <= l_i
    f_long = np.minimum(baseline[hardest], losses[i, long, hardest]).mean()
    return float((math.exp(f_short) - math.exp(f_long)) / math.exp(f_short))


def recl_search(losses: np.ndarray, contexts: list[int], r: float, threshold: float = THRESHOLD) -> list[Recl]:
    """RECL of every model of the group; losses [models, contexts, targets] on the same targets."""
    found = []
    for i in range(losses.shape[0]):
        step = next((k for k in range(len(contexts) - 1) if relative_gain(losses, i, k, k + 1, r) < threshold), None)
        found.append(Recl(contexts[-1], censored=True) if step is None else Recl(contexts[step]))
    return found


def recl(frame: pd.DataFrame, r: float, threshold: float = THRESHOLD) -> pd.DataFrame:
    """RECL per model of one group from a tidy frame with columns model, context, target, loss (every
    model at every context on the same targets). Returns columns model, recl, censored."""
    cube = frame.pivot_table(index=["model", "context"], columns="target", values="loss", aggfunc="first")
    models = list(dict.fromkeys(frame["model"]))
    contexts = sorted(frame["context"].unique())
    full = pd.MultiIndex.from_product([models, contexts], names=["model", "context"])
    cube = cube.reindex(full)
    values = cube.to_numpy().reshape(len(models), len(contexts), -1)  # (models, contexts, targets)
    values = values[:, :, ~np.isnan(values).any(axis=(0, 1))]  # targets every model scored at every context
    if len(contexts) < 2 or values.shape[2] == 0:
        raise ConfigError("recl", f"needs >= 2 contexts and shared targets; got contexts {contexts}, "
                          f"{values.shape[2]} targets scored by every model at every context")
    found = recl_search(values, [int(c) for c in contexts], r, threshold)
    return pd.DataFrame({"model": models, "recl": [f.context for f in found], "censored": [f.censored for f in found]})


def ladder_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Collected rows of RECL's ladder: sliding settings with stride 1 that saved their token losses."""
    if "token_losses" not in df:
        return df.iloc[0:0]
    mask = df["token_losses"].notna() & (df["protocol"] == "sliding") & (df["stride"] == 1)
    return df[mask & (df["status"] == "done")]


def token_loss_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per-target losses of the ladder, tidy: run_dir, context, target, loss, for the targets with the
    ladder's longest context in their stream (stream position p >= c_max - 1), so every context of
    the ladder scores them with exactly c tokens of context. `target` is the place b·T + p in the
    evaluation layout, the same for every run evaluated on the same split and streams."""
    rows = ladder_rows(df)
    if rows.empty:
        raise ConfigError("layout", "no RECL ladder in these runs (set eval.recl_contexts: sliding evaluations "
                          "with stride 1 that save every target's loss)")
    ladders = rows.groupby("run_dir")["segment_len"].apply(lambda s: tuple(sorted(s.astype(int))))
    if ladders.nunique() > 1:
        raise ConfigError("layout", f"runs evaluated different RECL ladders: {sorted(set(ladders))}")
    longest = max(ladders.iloc[0])
    parts, shapes = [], set()
    for run_dir, run in rows.groupby("run_dir", sort=False):
        arrays = rundir.read_token_losses(run_dir)
        if arrays is None or not set(run["token_losses"]) <= set(arrays):
            raise ConfigError(str(Path(run_dir) / rundir.TOKEN_LOSSES), "missing or unreadable")
        for record in run.itertuples(index=False):
            losses = arrays[record.token_losses]  # (B, T)
            shapes.add(losses.shape)
            targets = np.arange(losses.size).reshape(losses.shape)[:, longest - 1:]
            parts.append(pd.DataFrame({"run_dir": run_dir, "context": int(record.segment_len),
                                       "target": targets.ravel(), "loss": losses[:, longest - 1:].ravel()}))
    if len(shapes) > 1:
        raise ConfigError("layout", f"runs scored different evaluation layouts (streams, targets): {sorted(shapes)}; "
                          "RECL compares models on the same targets")
    return pd.concat(parts, ignore_index=True)
