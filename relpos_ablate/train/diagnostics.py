"""Attention diagnostics of an evaluation (docs/guide/evaluation.md#attention-diagnostics): the
training-side bookkeeping around model/diagnostics.py — what counts as a distance seen in training,
and a metric that sums the statistics over batches (and processes) and gives per layer and head
means."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from relpos_ablate.config import RunConfig
from relpos_ablate.model.diagnostics import STATISTICS, AttentionStatistics


def max_seen_distance(config: RunConfig) -> int:
    """The largest |q_pos - k_pos| training met: max_position - 1 with randomized positions; else
    the longest training input minus one (example tasks), or segment + memory minus one
    (streams)."""
    a = config.model.attention
    if a.positions == "randomized":
        return a.max_position - 1
    if config.data.example_task:
        return config.data.input_length(config.data.train_lengths[1]) - 1
    return config.train.segment_len + config.model.mem_len - 1


class AttentionDiagnostics(Metric):
    """Sums of the attention statistics over the counted queries, [4, layers, heads], and their
    count."""

    full_state_update = False

    def __init__(self, n_layers: int, n_heads: int, max_seen: int):
        super().__init__()
        self.n_layers, self.n_heads, self.max_seen = n_layers, n_heads, max_seen
        self.add_state(
            "sums",
            torch.zeros(len(STATISTICS), n_layers, n_heads, dtype=torch.float64),
            dist_reduce_fx="sum",
        )
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, mask: Tensor) -> None:
        """Count a batch's queries (mask [B, L]); the model then adds their statistics
        (`for_batch`)."""
        self.count += mask.sum()

    def for_batch(self, mask: Tensor) -> AttentionStatistics:
        """Where the model adds the statistics of a batch whose counted queries are `mask` [B,
        L]."""
        self.update(mask)
        return AttentionStatistics(self.n_layers, self.n_heads, mask, self.max_seen, sums=self.sums)

    def compute(self) -> dict[str, list[list[float]]]:
        """{statistic: per layer, per head mean over the counted queries}."""
        means = self.sums / self.count.clamp(min=1)
        return {name: means[k].tolist() for k, name in enumerate(STATISTICS)}
