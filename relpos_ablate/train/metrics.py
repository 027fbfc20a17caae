"""What training and evaluation measure: per-token loss and correctness, their means over the marked
tokens (exact across processes), the loss by position in the segment, and a run's main metric.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric

from relpos_ablate.config import RunConfig
from relpos_ablate.train.data.protocols import log_bins


def main_metric(config: RunConfig) -> str:
    return "acc" if config.data.source == "synthetic" else "ppl"


def token_stats(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token negative log-likelihood (nats, float32) and correctness, each [B, L]."""
    nll = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), reduction="none"
    ).view_as(targets)
    return nll, (logits.argmax(-1) == targets).float()


class MaskedMean(Metric):
    """Mean of a per-token value over the marked tokens, accumulated in float64 across batches.

    (torchmetrics' MeanMetric ignores its weights when nan_strategy='disable', and its other
    strategies sync with the host on every update.)"""

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: Tensor, mask: Tensor) -> None:
        self.total += (values.double() * mask).sum()
        self.count += mask.sum()

    def compute(self) -> Tensor:
        return self.total / self.count

    def synced(self) -> tuple[Tensor, Tensor]:
        """(mean, count) over the tokens of every process: their sums are added before dividing
        (exact, not a mean of means); in one process, this one's."""
        with self.sync_context():
            return self.total / self.count, self.count.clone()


class PositionLoss(Metric):
    """Summed loss and token count per position (column) of the evaluated segment or window."""

    def __init__(self, length: int):
        super().__init__()
        self.add_state("total", torch.zeros(length, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(length, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: Tensor, mask: Tensor) -> None:  # values, mask: [R, L]
        weights = mask.double()
        self.total += (values.double() * weights).sum(0)
        self.count += weights.sum(0)

    def compute(self) -> dict[str, list]:
        """{"edges": log-spaced bin edges, "loss": mean loss per bin (None when empty), "tokens":
        count}."""
        edges = log_bins(len(self.total))
        loss, tokens = [], []
        for lo, hi in zip(edges, edges[1:]):
            count = self.count[lo:hi].sum().item()
            loss.append(self.total[lo:hi].sum().item() / count if count else None)
            tokens.append(int(count))
        return {"edges": edges, "loss": loss, "tokens": tokens}
