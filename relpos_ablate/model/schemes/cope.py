"""CoPE (Golovneva et al. 2024, "Contextual Position Encoding: Learning to Count What's Important").

Query i gates every key it sees, g_ij = σ(s·q_i·k_j), and counts backwards: the contextual position
of key j is p_ij = Σ_{t=j..i} g_it over the keys t the query sees (keys it does not see count 0), so
p_ii = g_ii ∈ (0, 1) and p = i - j + 1 when every gate is 1. p is clamped to p_max - 1 and read from
a learned table e [p_max, d_head] by linear interpolation between ⌊p⌋ and ⌈p⌉; the score gets
s·q_i·e[p_ij]. As the authors' code (facebookresearch/RAM, projects/cope, default options): gates
from the scaled content logits, the position logit scaled by s like q·k, e shared by a layer's heads
and initialised at 0. docs/schemes/data-dependent.md#cope.

Here q is the content query the kernels use (q + u with term c, times the query scale when there is
one), so the gates read the content score as it enters the softmax. The gates need each query's
whole row of keys before the softmax (a cumulative sum over keys): the kernels run it on whole rows
of keys per query block. `scores` is the formula under autograd (explicit path, SDPA per block); the
block kernel (kernels/blockwise.py) calls `block_scores` and `block_backward`, the same scores and
their gradient by hand, so that nothing of a block is kept for backward and the gates' gradient
joins the attention's own dS (the gates read the same product s·q·kᵀ).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from relpos_ablate.model.core.terms import HandGradient, ScoreTerm, TermScheme

# The band kernel (`ContextualPositions.band_width`): keys are counted in chunks of BAND_CHUNK, and
# a count must pass p_max - 1 by COUNT_MARGIN to leave the band, far above fp32's rounding of a sum
# of gates (n·ε·64 = 0.016 for n = 4096 gates): the kernel, which counts in its own order, then
# finds no key beyond the band still counting
BAND_CHUNK = 16
COUNT_MARGIN = 0.25


class BlockPositions(NamedTuple):
    """What block_backward needs of a block's forward: the gates, ⌊p⌋, the fraction and the table's
    step e[n + 1] - e[n] read at ⌊p⌋ (all [B, H, L_b, K_b])."""

    gates: Tensor
    below: Tensor
    weight: Tensor
    step: Tensor


class ContextualPositions(TermScheme):
    """The table e [p_max, d_head] and the CoPE scores of a block of queries."""

    attribute = "contextual"

    @classmethod
    def build(cls, d_model, n_heads, d_head, config) -> ContextualPositions:
        return cls(config.cope_positions, d_head)

    def term(self, keys_input: Tensor, key_padding_mask: Tensor | None) -> ContextualTerm:
        return ContextualTerm(self)

    def __init__(self, n_positions: int, d_head: int):
        super().__init__()
        # (p_max, dh), zeros as the authors
        self.embeddings = nn.Parameter(torch.zeros(n_positions, d_head))

    @staticmethod
    def gates_and_counts(
        q: Tensor, k: Tensor, scale: float, visible: Tensor, diagonal: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """g_ij = σ(s·q_i·k_j) (0 for unseen keys) and Σ_{t >= j} g_it, unclamped: q [B, H, L, dh],
        k [B, H, K, dh] -> two [B, H, L, K]. `diagonal` (no autograd only), where visibility is
        causal: row r sees no key past column r + diagonal, and its other hidden keys lie before its
        window, where no visible key's count reaches; only the gates past the diagonal are then
        zeroed (tril_: 0.04 ms against masked_fill_'s 0.9 ms with the [L, K] mask on a block of 256
        x 402, B = 2, H = 8), those before the window keep their values (the kernels mask their
        scores)."""
        # counted in at least fp32: a bf16 sum of a hundred gates would be off by a quarter of a
        # position
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            logits = (q @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))
            gates = torch.sigmoid(logits * scale) * visible  # (B, H, L, K); unseen keys count 0
            # from key j to the last key (later ones: 0)
            return gates, gates.flip(-1).cumsum(-1).flip(-1)
        # no graph (the block kernel's forward): the same in the product's own buffer, per block on
        # a hot path
        gates = ContextualPositions._gates(q, k, scale)
        gates = gates.tril_(diagonal) if diagonal is not None else gates.masked_fill_(~visible, 0.0)
        return gates, gates.flip(-1).cumsum_(-1).flip(-1)

    def positions(self, q: Tensor, k: Tensor, scale: float, visible: Tensor) -> Tensor:
        """p_ij = Σ_{t >= j, t seen} σ(s·q_i·k_t), clamped to p_max - 1: [B, H, L, K]."""
        return self.gates_and_counts(q, k, scale, visible)[1].clamp(
            max=self.embeddings.shape[0] - 1
        )

    def scores(self, q: Tensor, k: Tensor, scale: float, visible: Tensor) -> Tensor:
        """s·q_i·e[p_ij], e interpolated between ⌊p⌋ and ⌈p⌉: [B, H, L, K]
        (geometry.ContextualScores: a block's queries, the kernels' content query, and its keys,
        without sinks)."""
        p = self.positions(q, k, scale, visible)
        per_position = (q @ self.embeddings.to(q.dtype).T) * scale  # (B, H, L, p_max): s·q_i·e[n]
        below = p.floor()
        weight = p - below  # the gradient reaches the gates through this weight
        low = per_position.gather(-1, below.long())
        high = per_position.gather(-1, p.ceil().long())
        return high * weight + low * (1 - weight)

    def band_width(
        self, q: Tensor, k: Tensor, scale: float, n_mem: int, rows: int | None = None
    ) -> int | None:
        """The band of a causal call, D: every query's count has passed p_max - 1 at each key D or
        more behind it (q [B, H, L, dh], k [B, H, M + L, dh]; query i at key index M + i). There its
        score is s·q_i·e[p_max - 1], one constant per query, which the softmax ignores: the band
        kernel (kernels/band.py) leaves those pairs to the causal flash kernel and builds the
        scores, minus that constant, within D only.

        Per block of `rows` queries (default 2·p_max, about the keys a count of gates near 1/2
        needs): each query's gates over the block's keys up to itself, then over the keys before the
        block in chunks of BAND_CHUNK, nearest first, on a tile widened (doubled) until every
        query's count passes p_max - 1 + COUNT_MARGIN; a query's band ends at the far edge of the
        chunk where it does (at most BAND_CHUNK - 1 keys wider than its count needs), or at the
        block's first key if its count passes before. A query whose count never passes puts its
        whole row in the band: how far the band reaches is the data's (host syncs). None for fewer
        than 2·p_max keys: a count passes p_max - 1 after p_max keys at the least, so the band would
        be the whole call."""
        positions, n_queries = self.embeddings.shape[0], q.shape[2]
        if k.shape[2] < 2 * positions:
            return None
        threshold, rows = positions - 1 + COUNT_MARGIN, rows or max(16, 2 * positions)
        # the block kernel's gates read fp32 q and k (bf16 widened)
        wide = torch.promote_types(q.dtype, torch.float32)
        q, k = q.to(wide), k.to(wide)
        # the keys before a block's first query its tile covers
        width = -(-2 * positions // BAND_CHUNK) * BAND_CHUNK
        band = 1
        with torch.no_grad():
            for i0 in range(0, n_queries, rows):
                i1 = min(i0 + rows, n_queries)
                first, q_b, row = n_mem + i0, q[:, :, i0:i1], torch.arange(i1 - i0, device=q.device)
                # keys to i'
                own = (
                    self._gates(q_b, k[:, :, first : n_mem + i1], scale)
                    .tril_()
                    .sum(-1, keepdim=True)
                )
                while True:
                    k0 = first - width
                    tile = self._gates(q_b, k[:, :, max(0, k0) : first], scale)
                    if k0 < 0:  # (no keys there: gates 0)
                        tile = torch.nn.functional.pad(tile, (-k0, 0))
                    # each chunk's gates summed, nearest first, then added up from the query on
                    counts = (
                        tile.view(*tile.shape[:-1], -1, BAND_CHUNK)
                        .sum(-1)
                        .flip(-1)
                        .cumsum_(-1)
                        .add_(own)
                    )
                    passed = counts > threshold  # (B, H, L_b, chunks)
                    reached = passed.any(-1)
                    if k0 <= 0 or bool(reached.all()):
                        break
                    width *= 2
                # to the far edge of the first chunk that passes
                chunks = passed.to(torch.uint8).argmax(-1) + 1
                # (else the whole row)
                reach = torch.where(reached, row + BAND_CHUNK * chunks, first + row + 1)
                reach = torch.where(own[..., 0] > threshold, row + 1, reach).minimum(
                    first + row + 1
                )
                band = max(band, int(reach.max()))
        return band

    @staticmethod
    def _gates(q: Tensor, k: Tensor, scale: float) -> Tensor:
        """σ(s·q·kᵀ) in at least fp32, in the product's own buffer (no autograd): [B, H, L, K]."""
        wide = torch.promote_types(q.dtype, torch.float32)
        # the scale on the queries, not on the scores: one pass over the block less
        if wide == q.dtype:
            return torch.sigmoid_(torch.matmul(q * scale, k.transpose(-1, -2)))
        return torch.sigmoid_((q @ k.transpose(-1, -2)).to(wide).mul_(scale))

    def block_scores(
        self,
        q: Tensor,
        k: Tensor,
        scale: float,
        visible: Tensor,
        shifted: bool = False,
        diagonal: int | None = None,
    ) -> tuple[Tensor, BlockPositions]:
        """`scores` without autograd, as s·q·e[⌊p⌋] + (p - ⌊p⌋)·s·q·(e[⌊p⌋ + 1] - e[⌊p⌋]) (one index
        for both reads), and what its backward needs. `shifted`: minus each query's s·q_i·e[p_max -
        1], the score of every key its count has passed p_max - 1 at (the band kernel's form: 0
        beyond the band, `band_width`). `diagonal` as in gates_and_counts."""
        wide = torch.promote_types(q.dtype, torch.float32)
        gates, counted = self.gates_and_counts(q, k, scale, visible, diagonal)  # (B, H, L_b, K_b)
        p = counted.clamp_(max=self.embeddings.shape[0] - 1)
        below = p.long()  # ⌊p⌋: counts are >= 0, where truncation is the floor
        weight = p.frac_()  # p - ⌊p⌋, exact
        # (B, H, L_b, p_max)
        per_position = (q @ self.embeddings.to(q.dtype).T).to(wide).mul_(scale)
        # e[n + 1] - e[n]; 0 after the last
        steps = torch.nn.functional.pad(per_position.diff(dim=-1), (0, 1))
        step = steps.gather(-1, below)
        scores = per_position.gather(-1, below).addcmul_(weight, step)
        if shifted:
            scores.sub_(per_position[..., -1:])
        return scores, BlockPositions(gates, below, weight, step)

    def block_backward(
        self, state: BlockPositions, grad: Tensor, q: Tensor, scale: float, shifted: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The gradient of the scores' sum against grad [B, H, L_b, K_b]: (its part through the
        gates, to add to the gradient of the product s·q·kᵀ, i.e. dS, divided by s; q's gradient
        through the table; the table's gradient). `shifted` as in `block_scores`."""
        n_positions = self.embeddings.shape[0]
        grad_above = grad * state.weight  # to s·q·e[⌊p⌋ + 1]
        grad_per_position = torch.zeros(
            *grad.shape[:-1], n_positions, dtype=grad.dtype, device=grad.device
        )
        grad_per_position.scatter_add_(-1, state.below, grad - grad_above)
        grad_per_position.scatter_add_(
            -1, (state.below + 1).clamp_(max=n_positions - 1), grad_above
        )
        if shifted:  # every key's score minus s·q·e[p_max - 1]
            grad_per_position[..., -1] -= grad.sum(-1)
        # through the fraction: p = counted clamped at p_max - 1, passing where counted <= p_max - 1
        # (torch.clamp); where it does not pass, ⌊p⌋ = p_max - 1 and the step read there is 0
        # (steps' padding), so step·grad is 0 there already
        grad_counted = state.step * grad
        # counted_j = Σ_{t >= j} gates_t: gates_t collects Σ_{j <= t}
        grad_gates = grad_counted.cumsum_(-1)
        # σ' = σ(1 - σ): g·σ - (g·σ)·σ in place; hidden keys have σ = 0
        grad_logits = grad_gates.mul_(state.gates).addcmul_(grad_gates, state.gates, value=-1.0)
        grad_per_position.mul_(scale)
        grad_q = grad_per_position @ self.embeddings.to(grad.dtype)
        grad_table = torch.einsum("bhlp,bhld->pd", grad_per_position, q.to(grad.dtype))
        return grad_logits, grad_q, grad_table


class ContextualTerm(ScoreTerm):
    """s·q̃_i·e[p_ij] in the forms the kernels ask for (core/terms.py): it reads the block's content
    queries (λ included: not scaled again) and keys over whole rows; its gradient by hand joins the
    attention's dS."""

    name = "cope"
    forms = frozenset({"content", "band", "hand"})
    scaled = False

    def __init__(self, module: ContextualPositions):
        self.module = module

    def parameters(self):
        return self.module.parameters()

    def block(self, call, block, q=None, k=None) -> Tensor:
        return self.module.scores(q, k, call.scale, call.visible(block))

    def hand_gradient(self, call, trained: bool) -> HandGradient:
        return _ContextualGradient(self.module)

    def band_width(self, call, q: Tensor, k: Tensor) -> int | None:
        return self.module.band_width(q, k, call.scale, call.n_mem)


class _ContextualGradient(HandGradient):
    def __init__(self, module: ContextualPositions):
        self.module = module

    def block(self, call, block, q, k, backward=False):
        return self.module.block_scores(
            q,
            k,
            call.scale,
            call.visible(block),
            shifted=call.far_from is not None,
            diagonal=call.causal_diagonal(block),
        )

    def backward(self, call, block, state, grad, grads, param_grads, q, grad_q):
        grad_logits, grad_query, grad_table = self.module.block_backward(
            state, grad, q, call.scale, shifted=call.far_from is not None
        )
        grad_q.add_(grad_query)
        if param_grads and param_grads[0] is not None:
            param_grads[0].add_(grad_table)
        return grad_logits


ContextualPositions.Term = ContextualTerm
