"""Document-aware evaluation: a text corpus with document separators (data.documents, a subword
tokenizer) is scored per document, by the position within the document, and beyond the training
length — whatever the protocol, from the per-target losses of the evaluation layout
(train/data/protocols.py).

The layout's stream b holds inputs x[b, 0..T-1]; the target at column p is x[b, p+1], predicted
after input x[b, p]. A document opens with its separator, so the target at column p belongs to the
document of input p (a separator as target closes that document), and its place in the document is
p minus the column of that document's separator: 0 for the document's first token (predicted from
the separator alone). A stream's first columns before its first separator continue a document that
began in the previous stream: they have no known place and are left out of every document metric
(`tokens_without_start` says how many).

eval.json's record of a setting gains "documents":
- `documents`, `loss`: how many documents had a scored target, and the mean over them of each one's
  mean loss (each document weighs one; `token_loss` weighs each token);
- `position_loss`: loss by place in the document, in the log bins of `position_loss` (0, 1, 2, 4,
  ... up to the longest place scored), with token counts;
- `beyond_train_length`: the loss and count of targets at place >= train.segment_len: documents
  longer than the training length, the natural extrapolation test (under packed_reset with sliding
  windows they are scored with the document's own context only).
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from relpos_ablate.train.data.protocols import log_bins


def places(inputs: Tensor, separator: int) -> tuple[np.ndarray, np.ndarray]:
    """(document, place) of every target of the layout's inputs [B, T]: the document's number
    (counted over the whole layout, -1 before a stream's first separator) and the target's place in
    it (-1 there too)."""
    tokens = np.asarray(inputs.long() if hasattr(inputs, "long") else inputs)
    opens = tokens == separator
    columns = np.arange(tokens.shape[1])
    # the column of the last separator at or before each column (-1: none yet)
    last = np.maximum.accumulate(np.where(opens, columns, -1), axis=1)
    started = last >= 0
    counts = np.cumsum(opens, axis=1)
    first_id = np.concatenate([[0], np.cumsum(opens.sum(1))[:-1]])[:, None]
    document = np.where(started, first_id + counts - 1, -1)
    place = np.where(started, columns - last, -1)
    return document, place


def document_metrics(
    document: np.ndarray, place: np.ndarray, losses: np.ndarray, train_length: int
) -> dict:
    """The "documents" record (module docstring) from the layout's (document, place) arrays [B, T]
    and per-target losses [B, T] (NaN: not scored)."""
    scored = ~np.isnan(losses) & (document >= 0)
    without_start = int((~np.isnan(losses) & (document < 0)).sum())
    docs, at, loss = document[scored], place[scored], losses[scored].astype(np.float64)
    record: dict = {"tokens": int(scored.sum()), "tokens_without_start": without_start}
    if not len(loss):
        return {**record, "documents": 0, "loss": None, "token_loss": None}
    ids, inverse = np.unique(docs, return_inverse=True)
    per_document = np.bincount(inverse, weights=loss) / np.bincount(inverse)
    edges = log_bins(int(at.max()) + 1)
    bins = np.searchsorted(edges, at, side="right") - 1
    sums = np.bincount(bins, weights=loss, minlength=len(edges) - 1)
    counts = np.bincount(bins, minlength=len(edges) - 1)
    beyond = at >= train_length
    return {
        **record,
        "documents": len(ids),
        "loss": float(per_document.mean()),
        "token_loss": float(loss.mean()),
        "position_loss": {
            "edges": [int(e) for e in edges],
            "loss": [float(s / c) if c else None for s, c in zip(sums, counts)],
            "tokens": [int(c) for c in counts],
        },
        "beyond_train_length": {
            "from": train_length,
            "loss": float(loss[beyond].mean()) if beyond.any() else None,
            "tokens": int(beyond.sum()),
        },
    }
