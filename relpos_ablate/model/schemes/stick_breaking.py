"""Stick-breaking attention (Tan et al., ICLR 2025, "Scaling Stick-Breaking Attention"): a
normaliser in place of the softmax.

Each earlier key j of query i breaks off a share β_ij = σ(z_ij) of what is left of a unit stick, the
nearest key first:

    A_ij = β_ij · ∏_{j<k<i'} (1 - β_ik),
    z_ij the score of the pair (s·q_i·k_j with no positional term)

so nearer keys are served first (a recency bias with no position encoding). The query's own key does
not break the stick (the authors' default, `attend_current=False`); what is left, 1 - Σ_j A_ij, goes
to it: their layer adds rem·v_i to the output, which is the weight rem on the query's own key. Rows
therefore sum to 1 when the query's own key is visible (a padded own key drops the remainder). Keys
outside a window break nothing. Computed in log space: log A_ij = log σ(z_ij) + Σ_{k>j} log
σ(-z_ik), the sum a reverse cumulative sum shifted by one key (a suffix sum, not a difference of two
large sums), in at least fp32. docs/schemes/score-readers.md#stick-breaking.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def stick_breaking(scores: Tensor, visible: Tensor, own: Tensor) -> Tensor:
    """Attention weights [B, H, L_b, K_b] from scores of the same shape; visible: bool,
    broadcastable (may query i see key j); own: bool [L_b, K_b], True at each query's own key (j =
    i')."""
    z = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    breaks = visible & ~own  # the keys that break the stick
    log_rest = F.logsigmoid(-z).masked_fill(~breaks, 0.0)  # log(1 - β_ij), 0 where nothing breaks
    suffix = log_rest.flip(-1).cumsum(-1).flip(-1)  # Σ_{k >= j}
    after = F.pad(suffix[..., 1:], (0, 1))  # Σ_{k > j}: the suffix of the next key
    weights = (F.logsigmoid(z) + after).exp().masked_fill(~breaks, 0.0)  # (B, H, L_b, K_b)
    remainder = 1.0 - weights.sum(-1, keepdim=True)
    weights = weights + remainder * (own & visible)
    return weights.to(scores.dtype)
