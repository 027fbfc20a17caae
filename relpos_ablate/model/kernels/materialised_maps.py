"""The maps of the block kernel (blockwise.py) that exist as tensors: each block's sum of the call's
additive terms, masked, rebuilt under autograd in backward, and the terms that give their gradient
by hand (ScoreTerm.hand_gradient) differentiated by their own hand (block_maps.py: the layouts and
the strided maps of distance alone)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.model.core.call import AttentionCall, QueryBlock, ScoreInputs, sum_terms
from relpos_ablate.model.core.terms import HandGradient, ScoreTerm
from relpos_ablate.model.kernels.block_maps import BlockLayout

# backward blocks of 256 queries: a query-position bias 220 -> 197 ms at L = 1024 and 2.34 -> 2.22 s
# at 4096, a cumulative decay on this kernel 1.84 -> 1.58 s at 4096, against 64 (one layer step; 512
# and 1024 alike). Tiles are then at least 256 keys wide, above tile_scores at L = 1024 (that bias's
# peak memory 1.55x / 1.14x attention without positions at 1024 / 4096); twice or four times wider
# tiles gained nothing
MATERIALISED_ROWS = 256


class MaterialisedMaps(BlockLayout):
    """Each block's map as a tensor: the sum of `call.additive_terms`, the terms with a hand form
    added after the rest, the sink columns in front, -inf where hidden.

    Backward splits a block's keys into tiles, but for sinks (in front of the first tile only) and
    terms that read content (over a query's whole row)."""

    reversed = False
    buffers = 3  # the map, the mask, and what autograd keeps to differentiate the map

    def __init__(self, call: AttentionCall, inputs: ScoreInputs):
        self.call, self.inputs = call, inputs
        whole_rows = call.n_sinks or any(t.reads_content for t in call.terms)
        self.rows = 0 if whole_rows else MATERIALISED_ROWS
        self._hands: list[HandGradient | None] | None = None
        self._param_slices = _slices([len(list(t.parameters())) for t in call.terms])
        self._tensor_slices = _slices([len(t.tensors) for t in call.terms])

    def hands(self, param_grads: list[Tensor | None] | None = None) -> list[HandGradient | None]:
        """Each term's hand form for this call (None: autograd), made at first use; param_grads:
        backward's (a term is `trained` where a gradient of its parameters is wanted)."""
        if self._hands is None:
            self._hands = [
                term.hand_gradient(
                    self.call,
                    param_grads is not None and any(g is not None for g in param_grads[cols]),
                )
                for term, cols in zip(self.call.terms, self._param_slices)
            ]
        return self._hands

    def _hand_pieces(self, block, q, k, backward, scale=None) -> list[HandPiece]:
        """The block's maps of the terms with a hand form, each times λ where it is scaled."""
        pieces = []
        for index, (term, hand) in enumerate(zip(self.call.terms, self.hands())):
            if hand is None:
                continue
            piece, state = hand.block(self.call, block, q, k, backward)
            if term.scaled and scale is not None:
                piece = piece * scale
            pieces.append(HandPiece(index, term, hand, piece, state))
        return pieces

    def _auto_terms(self) -> tuple:
        return tuple(t for t, h in zip(self.call.terms, self.hands()) if h is None)

    def additive_map(
        self, block: QueryBlock, q_content: Tensor | None = None, k: Tensor | None = None
    ) -> Tensor:
        """[B or 1, H, L_b, S + K_b]; q_content [B, H, L_b, dh] and the block's keys k [B, H, K_b,
        dh] (no sinks) for the terms that read content."""
        inputs = self.call.block_inputs(block, self.inputs)
        additive = sum_terms(
            self.call.additive_terms(block, inputs, q_content, k, terms=self._auto_terms())
        )
        for piece in self._hand_pieces(block, q_content, k, False, inputs.query_scale):
            additive = piece.map if additive is None else _plus(piece.map, additive)
        return self._masked(block, additive, own=True)

    def _masked(self, block: QueryBlock, additive: Tensor, own: bool) -> Tensor:
        """`own`: the map is this call's to overwrite (no other tensor or autograd reads it)."""
        visible = self.call.visible(block)
        if not visible.all():  # causal: only tiles on the diagonal hide keys
            hidden = ~visible
            # in place, from the first key any row hides (causal: the diagonal's)
            if own and visible.dim() == 2:
                first = int(hidden.any(0).to(torch.uint8).argmax())
                # as an added [L_b, K_b] map of 0 and -inf: ~3x faster than masked_fill_
                # broadcasting the bool mask over batch and heads (B = 2, H = 8, 256 x 402: 0.36
                # against 0.98 ms)
                minus_inf = torch.zeros(
                    hidden[:, first:].shape, dtype=additive.dtype, device=additive.device
                )
                additive[..., first:].add_(minus_inf.masked_fill_(hidden[:, first:], float("-inf")))
            else:  # (key padding broadcasts a shared map over the batch)
                additive = additive.masked_fill(hidden, float("-inf"))
        # sinks carry no position: 0
        return F.pad(additive, (block.n_sinks, 0)) if block.n_sinks else additive

    def rebuilt(
        self,
        block: QueryBlock,
        grads: ScoreInputs,
        term_grads: list[Tensor | None],
        param_grads: list[Tensor | None],
        content: tuple[Tensor, Tensor, Tensor],
    ):
        """(the block's mask, a function adding the gradient of a map gradient [B, H, L_b, S + K_b]
        onto `grads`, `term_grads` and `param_grads`): the map rebuilt under autograd from leaves,
        the terms with a hand form differentiated by their own hand. `content`: (q_content rows,
        their gradient, the block's keys without sinks); a hand form's addition to dS (a term that
        reads s·q·kᵀ) is added to the map gradient itself, last (the kernel's dS: it then reaches q
        and k through the products that carry s·q·kᵀ's)."""
        call = self.call
        self.hands(param_grads)
        block_grads = call.block_inputs(block, grads)
        q_rows, grad_q_rows, k_stream = content
        auto = []  # (term, its tensors' gradients, its parameters' gradients)
        for term, hand, tcols, pcols in zip(
            call.terms, self.hands(), self._tensor_slices, self._param_slices
        ):
            if hand is None:
                auto.append((term, term_grads[tcols], param_grads[pcols]))
        with torch.enable_grad():
            leaves = ScoreInputs(
                *(
                    None if t is None else t.detach().requires_grad_(g is not None)
                    for t, g in zip(call.block_inputs(block, self.inputs), block_grads)
                )
            )
            rebuilt_terms = tuple(
                term.with_tensors(
                    tuple(
                        t.detach().requires_grad_(g is not None) for t, g in zip(term.tensors, tg)
                    )
                )
                for term, tg, _ in auto
            )
            rest = sum_terms(call.additive_terms(block, leaves, terms=rebuilt_terms))
            pieces = self._hand_pieces(block, q_rows, k_stream, True, leaves.query_scale)
            scaled_wanted = leaves.query_scale is not None and leaves.query_scale.requires_grad
            if scaled_wanted:  # λ's gradient reads the hand-built maps too
                for piece in pieces:
                    rest = piece.map if rest is None else rest + piece.map
        wanted = [
            (view, leaf)
            for view, leaf in zip(block_grads, leaves)
            if view is not None and leaf.requires_grad
        ]
        for (_, tg, pg), term in zip(auto, rebuilt_terms):
            wanted += [(g, t) for g, t in zip(tg, term.tensors) if g is not None]
            wanted += [(g, p) for g, p in zip(pg, term.parameters()) if g is not None]
        scale = self.inputs.query_scale

        def add_gradients(grad_scores: Tensor) -> None:
            stream = grad_scores[..., block.n_sinks :]  # sinks have no map
            to_scores = []
            for piece in pieces:
                grad = stream
                if piece.term.scaled and scale is not None:
                    grad = stream * scale[:, :, block.rows]
                extra = piece.hand.backward(
                    call,
                    block,
                    piece.state,
                    grad,
                    term_grads[self._tensor_slices[piece.index]],
                    param_grads[self._param_slices[piece.index]],
                    q_rows,
                    grad_q_rows,
                )
                if extra is not None:
                    to_scores.append(extra)
            if rest is not None and wanted:
                # a map shared by the batch ([1, H, ...]) receives the batch's summed gradient
                shared = (
                    stream.sum(0, keepdim=True) if rest.shape[0] == 1 < stream.shape[0] else stream
                )
                for (target, _), g in zip(
                    wanted,
                    torch.autograd.grad(rest, [t for _, t in wanted], shared, allow_unused=True),
                ):
                    if g is not None:
                        target.add_(g)
            for extra in to_scores:  # last: the map's other gradients read dS without it
                stream.add_(extra)

        additive = rest.detach() if rest is not None else None
        if not scaled_wanted:
            for piece in pieces:
                additive = piece.map if additive is None else _plus(piece.map, additive)
        own = not wanted or bool(pieces) and not scaled_wanted
        return self._masked(block, additive, own=own), add_gradients

    def finish(self, param_grads: list[Tensor | None]) -> None:
        """Add the parameters' gradients that the hand forms summed over the tiles."""
        for hand, cols in zip(self._hands or [], self._param_slices):
            if hand is not None:
                hand.finish(param_grads[cols])


class HandPiece(NamedTuple):
    """A block's map of a term with a hand form (times λ where scaled) and what its backward
    reads."""

    index: int  # the term's place in call.terms
    term: ScoreTerm
    hand: HandGradient
    map: Tensor
    state: Any


def _plus(piece: Tensor, additive: Tensor) -> Tensor:
    """additive + piece (the piece last, as sum_terms adds it) in a new tensor or in piece."""
    return piece.add_(additive) if additive.shape == piece.shape else additive + piece


def _slices(counts: list[int]) -> list[slice]:
    """Consecutive slices of the given lengths."""
    edges = [0]
    for n in counts:
        edges.append(edges[-1] + n)
    return [slice(a, b) for a, b in zip(edges, edges[1:])]
