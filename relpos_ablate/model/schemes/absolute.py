"""Where the tokens of a segment sit, as the language model places them: a learned absolute
position table (the `learned` and `learned_per_layer` baselines), explicit positions checked
against it, and the randomized positions and distances of Ruoss et al. 2023
(docs/schemes/baselines.md)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LearnedPositions(nn.Module):
    """A learned absolute position table; a segment longer than the table is a clear error."""

    def __init__(self, max_position: int, d_model: int):
        super().__init__()
        self.table = nn.Embedding(max_position, d_model)

    def forward(self, length: int, positions: Tensor | None = None) -> Tensor:
        """Rows 0 .. length - 1, or the rows of explicit positions [length] (or [B, length]: per
        row, packed documents): [(B,) length, d_model]."""
        if positions is not None:
            return self.table(
                check_positions(positions, self.table.num_embeddings, "learned absolute positions")
            )
        if length > self.table.num_embeddings:
            raise ValueError(
                f"model.attention.max_position: learned absolute positions cover "
                f"0..{self.table.num_embeddings - 1}; a segment of {length} tokens does not fit "
                f"(relative schemes have no such limit)"
            )
        return self.table.weight[:length]


def check_positions(positions: Tensor, max_position: int, what: str) -> Tensor:
    """positions, or a one-line error when one of them is outside 0 .. max_position - 1."""
    if positions.min() < 0 or positions.max() >= max_position:
        raise ValueError(
            f"model.attention.max_position: {what} cover 0..{max_position - 1}; got positions "
            f"{int(positions.min())}..{int(positions.max())}"
        )
    return positions


def randomized_positions(n_tokens: int, max_position: int, device=None, generator=None) -> Tensor:
    """Ruoss et al. 2023: n distinct positions drawn from [0, max_position) without replacement,
    sorted: [n]."""
    if n_tokens > max_position:
        raise ValueError(
            f"model.attention.max_position: randomized positions draw {n_tokens} distinct "
            f"positions from [0, {max_position}); raise max_position to at least {n_tokens}"
        )
    return torch.randperm(max_position, device=device, generator=generator)[:n_tokens].sort().values


def randomized_distances(n_keys: int, max_position: int, device=None, generator=None) -> Tensor:
    """Ruoss et al.'s code for relative encodings: d_0 = 0, then n - 1 distinct distances drawn from
    [1, max_position) without replacement, sorted: d_r is what offset r reads. [n]"""
    if n_keys > max_position:
        raise ValueError(
            f"model.attention.max_position: randomized distances draw {n_keys - 1} distinct "
            f"distances from [1, {max_position}); raise max_position to at least {n_keys}"
        )
    drawn = (
        torch.randperm(max_position - 1, device=device, generator=generator)[: n_keys - 1]
        .sort()
        .values
        + 1
    )
    return torch.cat([drawn.new_zeros(1), drawn])
