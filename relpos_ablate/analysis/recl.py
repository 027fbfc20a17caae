"""RECL, the Relative Effective Context Length of Transformer-XL (Dai et al. 2019, §4.3 and App. C),
for a group of models, from per-token losses at a ladder of context lengths
(docs/guide/evaluation.md#recl).

For each context c of the ladder, l_i(c, t) is model i's loss on target t with exactly c tokens of
context (runs evaluate it with `eval.recl_contexts`, saving every target's loss: a model with memory
through its memory, every query seeing c keys, as the paper measures recurrent models; one without
through sliding windows of c tokens, stride 1). With b(c, t) = min_i l_i(c, t) the group's best loss
and T the top-r fraction of targets by b(c, t) (re-chosen for every c):

    f_i(c, c') = mean over t in T of min(b(c, t), l_i(c', t))
    g_i(c, c') = (exp f_i(c, c) - exp f_i(c, c')) / exp f_i(c, c)

Starting at the ladder's first c with c' the next one, RECL_i is the first c whose gain g_i(c, c')
falls below the threshold (1%), or (our guard, not the paper's) whose own mean loss on T does not
fall from c to c'; c then steps to c'. A model still gaining at the last step gets the last context,
marked as a lower bound (censored).
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
    """g_i(c, c') for model i between ladder steps short (c) and long (c'); losses [models,
    contexts, targets]."""
    baseline = losses[:, short].min(0)  # b(c, t): the group's best loss at context c
    hardest = top_fraction(baseline, r)  # T, chosen again for every c
    f_short = np.minimum(
        baseline[hardest], losses[i, short, hardest]
    ).mean()  # = mean b(c, t): b <= l_i
    f_long = np.minimum(baseline[hardest], losses[i, long, hardest]).mean()
    return float((math.exp(f_short) - math.exp(f_long)) / math.exp(f_short))


def own_gain(losses: np.ndarray, i: int, short: int, long: int, r: float) -> float:
    """How much model i's own mean loss on T (the targets relative_gain uses) falls from c to c'."""
    hardest = top_fraction(losses[:, short].min(0), r)
    return float(losses[i, short, hardest].mean() - losses[i, long, hardest].mean())


def recl_search(
    losses: np.ndarray, contexts: list[int], r: float, threshold: float = THRESHOLD
) -> list[Recl]:
    """RECL of every model of the group; losses [models, contexts, targets] on the same targets. A
    step counts only while the model's own loss on T falls too (own_gain > 0; our guard, not the
    paper's): the gain g compares against the group's best loss at c, so a model far above it could
    otherwise collect gains from a few noisy targets while its own loss rises with context."""
    found = []
    for i in range(losses.shape[0]):
        step = next(
            (
                k
                for k in range(len(contexts) - 1)
                if relative_gain(losses, i, k, k + 1, r) < threshold
                or own_gain(losses, i, k, k + 1, r) <= 0
            ),
            None,
        )
        found.append(Recl(contexts[-1], censored=True) if step is None else Recl(contexts[step]))
    return found


def recl(frame: pd.DataFrame, r: float, threshold: float = THRESHOLD) -> pd.DataFrame:
    """RECL per model of one group from a tidy frame with columns model, context, target, loss
    (every model at every context on the same targets). Returns columns model, recl, censored."""
    cube = frame.pivot_table(
        index=["model", "context"], columns="target", values="loss", aggfunc="first"
    )
    models = list(dict.fromkeys(frame["model"]))
    contexts = sorted(frame["context"].unique())
    full = pd.MultiIndex.from_product([models, contexts], names=["model", "context"])
    cube = cube.reindex(full)
    values = cube.to_numpy().reshape(len(models), len(contexts), -1)  # (models, contexts, targets)
    # targets every model scored at every context
    values = values[:, :, ~np.isnan(values).any(axis=(0, 1))]
    if len(contexts) < 2 or values.shape[2] == 0:
        raise ConfigError(
            "recl",
            f"needs >= 2 contexts and shared targets; got contexts {contexts}, "
            f"{values.shape[2]} targets scored by every model at every context",
        )
    found = recl_search(values, [int(c) for c in contexts], r, threshold)
    return pd.DataFrame(
        {
            "model": models,
            "recl": [f.context for f in found],
            "censored": [f.censored for f in found],
        }
    )


def fixed_context(protocol, stride):
    """Whether an evaluation setting gives every target exactly its attn_len tokens of context:
    memory with same_length (protocol xl), or sliding windows moved by one token. Works on one
    setting's values (a bool) and on a frame's columns (a boolean Series)."""
    return (protocol == "xl") | ((protocol == "sliding") & (stride == 1))


def shared_targets(losses: np.ndarray, longest: int) -> np.ndarray:
    """The part of a (streams, targets) token-loss array that every setting of a ladder scores with
    its full context: the targets at stream position p >= longest - 1, longest being the ladder's
    longest context."""
    return losses[:, longest - 1 :]


def ladder_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Collected rows of each run's RECL ladder: the settings that saved their token losses with a
    fixed context, of the run's own kind (config.evaluation.recl_settings): memory with same_length
    (protocol xl) for a model trained with memory, sliding windows with stride 1 for one without.
    Context c is the setting's attn_len (the keys every query sees: the window, or mem_len)."""
    if "token_losses" not in df:
        return df.iloc[0:0]
    recurrent = (
        pd.to_numeric(
            df.get("model.mem_len", pd.Series(0, index=df.index)), errors="coerce"
        ).fillna(0)
        > 0
    )
    own = np.where(recurrent, "xl", "sliding")
    mask = (
        df["token_losses"].notna()
        & fixed_context(df["protocol"], df["stride"])
        & (df["protocol"] == own)
    )
    return df[mask & (df["status"] == "done")]


def token_loss_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Per-target losses of the ladder, tidy: run_dir, context, target, loss, for the targets with
    the ladder's longest context in their stream (stream position p >= c_max - 1), so every context
    of the ladder scores them with exactly c tokens of context. `target` is the place b·T + p in the
    evaluation layout, the same for every run evaluated on the same split and streams."""
    rows = ladder_rows(df)
    if rows.empty:
        raise ConfigError(
            "layout",
            "no RECL ladder in these runs (set eval.recl_contexts: evaluations at a fixed "
            "context that save every target's loss)",
        )
    ladders = rows.groupby("run_dir")["attn_len"].apply(lambda s: tuple(sorted(s.astype(int))))
    if ladders.nunique() > 1:
        raise ConfigError(
            "layout", f"runs evaluated different RECL ladders: {sorted(set(ladders))}"
        )
    longest = max(ladders.iloc[0])
    parts, shapes = [], set()
    for run_dir, run in rows.groupby("run_dir", sort=False):
        arrays = rundir.read_token_losses(run_dir)
        if arrays is None or not set(run["token_losses"]) <= set(arrays):
            raise ConfigError(str(Path(run_dir) / rundir.TOKEN_LOSSES), "missing or unreadable")
        for record in run.itertuples(index=False):
            losses = arrays[record.token_losses]  # (B, T)
            shapes.add(losses.shape)
            targets = shared_targets(np.arange(losses.size).reshape(losses.shape), longest)
            parts.append(
                pd.DataFrame(
                    {
                        "run_dir": run_dir,
                        "context": int(record.attn_len),
                        "target": targets.ravel(),
                        "loss": shared_targets(losses, longest).ravel(),
                    }
                )
            )
    if len(shapes) > 1:
        raise ConfigError(
            "layout",
            f"runs scored different evaluation layouts (streams, targets): {sorted(shapes)}; "
            "RECL compares models on the same targets",
        )
    return pd.concat(parts, ignore_index=True)
