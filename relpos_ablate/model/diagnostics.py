"""Attention statistics that explain a length-generalization failure, gathered during evaluation.

For every counted query (the evaluation's mask) and every head of every layer, from the attention
probabilities p_ij over the keys the query sees:
- `entropy`: -Σ_j p_ij log p_ij in nats (log of the number of visible keys when attention is
  uniform);
- `sink`: p_ij at the first key the query sees, the first token of its window (key 0 without a
  window);
- `distance`: Σ_j p_ij |i' - j|, the mean attended distance in tokens (by index, query i at i' = M +
  i);
- `unseen`: Σ_j p_ij [|q_pos_i - k_pos_j| > max_seen_distance], the mass on distances the encoding
  (which reads positions, so randomized ones count as drawn) never met in training.

`AttentionStatistics` holds their sums over the counted queries, [4, layers, heads] in float64; the
caller divides by the counted queries (`means`). The attention hands each query block's
probabilities to `LayerStatistics.add` in the same forward that computes the output: the fast
kernels never materialise them, so with statistics the attention computes them per query block
(dispatch.py `_observed`), which costs what SDPA's math kernel costs at evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relpos_ablate.model.core.geometry import BlockView

STATISTICS = ("entropy", "sink", "distance", "unseen")


class AttentionStatistics:
    """Sums over the counted queries of every statistic, per layer and head: [4, layers, heads]."""

    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        query_weight: Tensor,
        max_seen_distance: float,
        sums: Tensor | None = None,
    ):
        """query_weight [B, L]: how much each query of the batch counts (the evaluation mask);
        max_seen_distance: the largest |q_pos - k_pos| of training; sums: add into this tensor
        (e.g. a metric's state) instead of a new one."""
        shape = (len(STATISTICS), n_layers, n_heads)
        if sums is not None and tuple(sums.shape) != shape:
            raise ValueError(f"sums: expected shape {list(shape)}, got {list(sums.shape)}")
        self.sums = (
            sums
            if sums is not None
            else torch.zeros(shape, dtype=torch.float64, device=query_weight.device)
        )
        self.query_weight = query_weight
        self.max_seen_distance = max_seen_distance

    def layer(self, index: int) -> LayerStatistics:
        """Where layer `index` adds its statistics (AttentionOptions.statistics)."""
        return LayerStatistics(self, index)

    def means(self) -> dict[str, Tensor]:
        """{statistic: [layers, heads]} means over the counted queries of this batch."""
        count = self.query_weight.sum().clamp(min=1).double()
        return {name: self.sums[k] / count for k, name in enumerate(STATISTICS)}


@dataclass(frozen=True)
class LayerStatistics:
    """One layer's view of an AttentionStatistics."""

    target: AttentionStatistics
    layer: int

    def add(self, view: BlockView, probs: Tensor) -> None:
        """Add the statistics of one query block's probabilities [B, H, L_b, K_b] (module docstring;
        geometry.StatisticsSink)."""
        p = probs.detach().to(torch.promote_types(probs.dtype, torch.float32))  # bf16/fp16 -> fp32
        first = view.visible.int().argmax(-1, keepdim=True)  # the first key each query sees
        token_distance = (view.query_index[:, None] - view.key_index[None]).abs()
        position_distance = (view.query_positions[:, None] - view.key_positions[None]).abs()
        # distance and unseen weigh each key; one product over the keys gives both: (L_b, K_b, 2)
        weights = torch.stack(
            [token_distance, position_distance > self.target.max_seen_distance], -1
        ).to(p.dtype)
        weighted = torch.einsum("bhlk,lkc->cbhl", p, weights)  # (2, B, H, L_b)
        # (4, B, H, L_b)
        per_query = torch.cat(
            [
                torch.special.entr(p).sum(-1)[None],  # -p log p, 0 at p = 0
                p.gather(-1, first.expand(*p.shape[:-1], 1)).squeeze(-1)[None],
                weighted,
            ]
        )
        weight = self.target.query_weight[:, view.rows].double()  # (B, L_b)
        self.target.sums[:, self.layer] += torch.einsum("sbhl,bl->sh", per_query.double(), weight)
