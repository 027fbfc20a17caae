"""Where the queries and keys of an attention call sit (`Placement`, made by `place`): the positions
the encodings read and the distances the per-distance tensors list.

Two things are kept apart on purpose:
- **Visibility is by index** (geometry.Visibility): query i (key index i' = M + i) sees key j by the
  causal rule, the window, key padding and the documents (a query sees its own document's keys
  only), whatever positions they carry.
- **Encodings read positions**: RoPE rotates by them, every bias and terms b/d are evaluated at the
  distance q_pos - k_pos. By default positions are consecutive (query i at M + i, keys 0 .. K - 1),
  and the per-distance tensors are laid out per key by strided views (shift.py: `rel_shift`,
  `toeplitz`), the fast path. Explicit positions (`AttentionOptions.positions`: randomized
  positions, or any scheme that moves tokens) set `distance_index`: the column of every (query,
  key) pair in the per-distance tensors, which are then gathered instead (call.py: `per_key`,
  `term_b`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from relpos_ablate.model.core.geometry import Visibility
from relpos_ablate.model.core.shift import descending_distances


class Placement(NamedTuple):
    """Where a call's queries and keys sit (call.place) and which keys are padding."""

    query_positions: Tensor  # [L] positions the encodings read
    key_positions: Tensor  # [K]
    # [n] the distances the per-distance tensors list, descending (their column order)
    distances: Tensor
    # [L, K] column of each pair; None: consecutive positions (strided views)
    distance_index: Tensor | None = None
    # distances are drawn per offset (AttentionOptions.distances), not the positions'
    drawn_distances: bool = False
    key_padding_mask: Tensor | None = None  # [B, K]
    document_ids: Tensor | None = None  # [B, K]: a query sees the keys of its own document only


def place(
    visibility: Visibility,
    n_queries: int,
    positions: Tensor | None,
    device,
    distances: Tensor | None = None,
) -> Placement:
    """Where the queries and keys of a call sit, and the distances its per-distance tensors list.

    Consecutive positions (None): keys 0 .. K - 1, queries M .. K - 1, the K + L - 1 distances in
    shift.py's descending order, no index (strided views lay them out). Explicit positions [K]: the
    distances q_pos - k_pos of the visible pairs, from the largest to the smallest, and
    distance_index [L, K], the column of each pair (pairs no query sees are clamped into range: the
    mask hides them). Reading the range costs one host sync per call. Explicit distances [K]
    (AttentionOptions.distances): the descending offsets of the consecutive layout, each read as its
    drawn distance, so the strided views still lay them out; positions, if given, only place
    RoPE."""
    n_keys = visibility.n_mem + n_queries
    if distances is not None:
        if distances.shape != (n_keys,):
            raise ValueError(
                f"distances: expected [M + L] = [{n_keys}] distances d_0 .. d_(M+L-1), "
                f"got {list(distances.shape)}"
            )
        keys = (
            torch.arange(n_keys, device=device)
            if positions is None
            else _checked(positions, n_keys, device)
        )
        offsets = descending_distances(visibility.n_mem, n_queries, n_keys, device)
        drawn = distances.to(device=device, dtype=torch.long)[offsets.abs()] * offsets.sign()
        return Placement(keys[visibility.n_mem :], keys, drawn, None, drawn_distances=True)
    if positions is None:
        consecutive = torch.arange(n_keys, device=device)
        return Placement(
            consecutive[visibility.n_mem :],
            consecutive,
            descending_distances(visibility.n_mem, n_queries, n_keys, device),
        )
    positions = _checked(positions, n_keys, device)
    query_positions = positions[visibility.n_mem :]
    pair_distances = query_positions[:, None] - positions[None, :]  # (L, K)
    seen = visibility(
        torch.arange(n_queries, device=device)[:, None],
        torch.arange(n_keys, device=device)[None, :],
    )
    smallest, largest = (int(d) for d in torch.aminmax(pair_distances[seen]))
    return Placement(
        query_positions,
        positions,
        torch.arange(largest, smallest - 1, -1, device=device),
        (largest - pair_distances).clamp(0, largest - smallest),
    )


def _checked(positions: Tensor, n_keys: int, device) -> Tensor:
    if positions.shape != (n_keys,):
        raise ValueError(
            f"positions: expected [M + L] = [{n_keys}] key positions shared by the batch, "
            f"got {list(positions.shape)}"
        )
    return positions.to(device=device, dtype=torch.long)
