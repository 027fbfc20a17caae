"""Packed documents (data.documents: packed_reset): several documents in one row, each attending to
itself only, its positions restarting at its first token.

One mechanism serves every scheme: `document_ids` [B, M + L] (memory first) narrows who sees whom
(core/call.py `per_row`: a query sees the keys of its own document), on every kernel, as key
padding does. Under that mask every relative encoding reads only distances inside the document,
which are the distances of the document alone, so RoPE, every bias of distance, terms b and d, FoX's
decay D_ij = Λ_i - Λ_j, stick-breaking's and CoPE's sums over the keys between j and i, PaTH's and
GRAPE's products over them and the learned sinks (slots every query sees) all restart with the
document without a line of their own. What reads a query's place in the stream besides distances
does not: absolute positions (the LM restarts them: `document_positions`), log-n and SSMax scaling
(they count the keys a query sees: the mask counts the document's), Llama 4's temperature tuning
(it reads `document_positions`), Canon's convolution (its taps stop at the document's first token).
Refused, one line each (`check`): a bias that reads the query position besides the distance (FIRE),
chunked attention (chunks are cut by index), explicit or drawn positions, dynamic NTK scaling (it
reads the stream's length). Memory keys carry their documents' ids, so memory of another document
is dropped at the boundary (docs/guide/documents.md).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.config.attention import AttentionConfig
from relpos_ablate.config.scheme_checks import document_refusal
from relpos_ablate.model.core.options import AttentionOptions
from relpos_ablate.model.core.placement import Placement


def document_positions(documents: Tensor) -> Tensor:
    """[B, K] ids (each document's tokens consecutive) -> [B, K] the place of each token in its
    document as far as the row shows it: 0 at the document's first token in the row."""
    first = torch.searchsorted(documents.contiguous(), documents.contiguous(), side="left")
    return torch.arange(documents.shape[1], device=documents.device) - first


def causal_conv(x: Tensor, weight: Tensor, documents: Tensor) -> Tensor:
    """A depthwise causal convolution that stops at each document's first token: x [B, K, C],
    weight [C, 1, k] (Conv1d's, tap s = weight[..., k - 1 - s] on x_{t-s}), documents [B, K] ->
    [B, K, C], zeros before a document's first token as before a stream's (Canon, PaTH's w)."""
    width, out = weight.shape[-1], 0
    for s in range(width):
        earlier = F.pad(x, (0, 0, s, 0))[:, : x.shape[1]]  # x_{t-s}
        same = F.pad(documents, (s, 0), value=-1)[:, : x.shape[1]] == documents
        out = out + weight[:, 0, width - 1 - s] * earlier * same[..., None]
    return out


def placed_per_row(placement: Placement) -> Placement:
    """The placement the q/k transforms read (RoPE, PoPE, MLA's rotary key): over packed documents,
    each token at its place in its document, queries [B, 1, L] and keys [B, 1, K] (per row,
    broadcast over the heads); otherwise the placement itself."""
    if placement.document_ids is None:
        return placement
    at = document_positions(placement.document_ids)[:, None]  # (B, 1, K)
    n_queries = placement.query_positions.shape[0]
    return placement._replace(query_positions=at[..., -n_queries:], key_positions=at)


def with_documents(
    config: AttentionConfig,
    options: AttentionOptions,
    documents: Tensor | None,
    x: Tensor,
    mems: Tensor | None,
) -> AttentionOptions:
    """The call's options with its document ids [B, M + L] (`documents`, else the options' own),
    checked: a ValueError naming what cannot run over packed documents (the module docstring)."""
    documents = options.document_ids if documents is None else documents
    checked(documents, x.shape[0], x.shape[1], 0 if mems is None else mems.shape[1])
    reason = refusal(config, options)
    if reason:
        raise ValueError(f"document_ids: {reason}")
    return dataclasses.replace(options, document_ids=documents)


def checked(documents: Tensor, batch: int, n_queries: int, n_mem: int) -> Tensor:
    """`documents` if they are integer ids [B, M + L] of a call of `batch` rows, `n_queries`
    queries and `n_mem` memory keys, else a one-line ValueError (the LM's and the attention's
    entry points alike)."""
    shape = (batch, n_mem + n_queries)
    if tuple(documents.shape) != shape or documents.is_floating_point():
        hint = "; with memory give the memory's ids first" if n_mem else ""
        raise ValueError(
            f"document_ids: expected integer ids [B, M + L] = {list(shape)}, got "
            f"{documents.dtype} {list(documents.shape)}{hint}"
        )
    return documents


def refusal(config: AttentionConfig, options=None) -> str | None:
    """Why a layer (and a call's options) cannot honour packed documents, or None."""
    reason = document_refusal(config)
    if reason or options is None:
        return reason
    if options.positions is not None or options.distances is not None:
        return "explicit positions or distances place the whole row, not each document"
    if options.rope_scaling is not None and options.rope_scaling.kind == "dynamic":
        return "dynamic NTK scaling reads the row's length, not the document's"
    return None
