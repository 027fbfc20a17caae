"""Which kernels can compute an attention call, decided from the forms of its parts: the one planner
that the kernels' dispatcher (model/kernels/dispatch.py, from a call) and the configuration checks
(config/scheme_checks.py, from a config, before anything runs) both ask. Torch-free on purpose:
validating a config must not import torch.

A call adds to s·q·kᵀ its per-distance parts (term b's product over distances, a curve over
distances: term d and a bias of distance alone) and its score terms (model/core/terms.py). Each
part supplies some of these forms (the vocabulary the schemes declare, in their `forms` and their
registry line):

- `key_offsets`: the part is e_j - e_i' for a key offset e (a bias linear in the distance; FoX);
- `band`: from a distance D on, the part is one constant per query (a clamp, T5's last bucket,
  CoPE's clamped count);
- `content`: the part reads the block's queries and keys over whole rows (CoPE), and `hand`: it
  gives its gradient by hand (required of a content term on the block kernel);
- `query_position`: a bias that reads the query position besides the distance (FIRE);
- `sinks`: the scheme prepends sink slots to the keys (learned sinks, the sink logit).

The kernels ask (their data-dependent conditions — a device, a slope's sign, a band's length —
stay with them):
- `low_rank`: plain causal, no term b, every part a key offset;
- `band`: plain causal, and either per-distance parts that all saturate and no score term, or no
  per-distance part and score terms that all have a band;
- `flex`: no part reads content;
- `blocks` and `sdpa` (per block): every call whose scores no scheme reads itself (`reads_scores`:
  stick-breaking, PaTH, DAPE take the explicit path), `blocks` only where content terms have their
  gradient by hand.
"""

from __future__ import annotations

from typing import NamedTuple

#: the forms a part may declare
FORMS = ("key_offsets", "band", "content", "hand", "query_position", "sinks")


class Plan(NamedTuple):
    """What the planner reads of a call or a config."""

    #: causal over the whole stream at consecutive positions, with no window, key padding, sinks,
    #: query scale or drawn distances
    plain_causal: bool
    #: term b's product over distances
    product: bool = False
    #: the forms of the per-distance curve (term d and a bias of distance alone), None: no curve
    curve: frozenset[str] | None = None
    #: every per-distance part is constant from a distance on (R clamped, the bias's `band`)
    saturates: bool = False
    #: each score term's forms
    terms: tuple[frozenset[str], ...] = ()
    #: a scheme reads the summed scores (explicit path only)
    reads_scores: bool = False

    @property
    def per_distance(self) -> bool:
        return self.product or self.curve is not None


def low_rank(plan: Plan) -> bool:
    """Every part is a key offset (and there is one)."""
    parts = ([plan.curve] if plan.curve is not None else []) + list(plan.terms)
    return (
        plan.plain_causal
        and not plan.reads_scores
        and not plan.product
        and bool(parts)
        and all("key_offsets" in forms for forms in parts)
    )


def band(plan: Plan) -> bool:
    """Every part is constant from a distance on: the per-distance parts alone or the score terms
    alone."""
    if not plan.plain_causal or plan.reads_scores:
        return False
    if plan.per_distance:
        return not plan.terms and plan.saturates
    return bool(plan.terms) and all("band" in forms for forms in plan.terms)


def flex(plan: Plan) -> bool:
    """No part reads content (FlexAttention's score_mod sees one pair at a time)."""
    return not plan.reads_scores and not any("content" in forms for forms in plan.terms)


def blocks(plan: Plan) -> bool:
    """The block kernel: a content term only with its gradient by hand."""
    return not plan.reads_scores and all(
        "hand" in forms for forms in plan.terms if "content" in forms
    )


def reads_query_position(plan: Plan) -> bool:
    """A part reads the query position besides the distance."""
    parts = ([plan.curve] if plan.curve is not None else []) + list(plan.terms)
    return any("query_position" in forms for forms in parts)
