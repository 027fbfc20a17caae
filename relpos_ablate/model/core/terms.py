"""The one interface between a score term and the kernels: a term owns every form of itself.

A score term is one additive part B_ij of the scores that a scheme builds once per forward from
what it reads (the layer's input, the positions, its parameters) and hands to the kernels in
`AttentionCall.terms`. Terms b and d of Transformer-XL and a bias of distance alone are the call's
per-distance tensors (call.ScoreInputs); every other scheme is a `ScoreTerm` in its own file
(docs/extending/content-term.md). A kernel asks a term for a *form*, never for a scheme, and takes a
call only where every term supplies the form it needs (planner.py decides which kernels can):

- `block` (every term): the dense map of a query block, [B or 1, H, L_b, K_b], as it enters the
  sum (the query scale λ is the call's to apply, where `scaled`). The materialised kernels, the
  explicit path and `score_terms` read it; the block kernel differentiates it by autograd in
  backward, unless the term gives its gradient by hand.
- `hand_gradient` (optional): a `HandGradient`, the block's map and its gradient taken by the term
  itself, where autograd through `block` is slow or where the term reads the block's queries and
  keys (`reads_content`: its gradient then reaches q through the attention's own dS).
- `key_offsets` (optional): e [B or 1, H, K] float64 where B_ij = e_j - e_i' (the low-rank kernel
  adds e as extra channels of the heads).
- `point` (optional): B of one pair as a function of index tensors (FlexAttention's score_mod);
  without it FlexAttention reads the term's dense map of the whole call.
- `band_width` (optional): a distance D from which each query's B is one constant (the band
  kernel).

The tensors a term was built from under autograd (`tensors`: FoX's Λ) cross the block kernel's
autograd boundary explicitly and come back through `with_tensors` (leaves in backward, widened
copies, detached copies to time the kernels); module parameters the forms read directly
(`parameters`) get their gradients from the rebuild of each block, or from the hand form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from relpos_ablate.model.core.geometry import QueryBlock
from relpos_ablate.model.core.parts import Part

#: the AttentionCall (core/call.py) a term is handed: that module imports this one, so the type is
#: named here, not imported
AttentionCall = Any

#: FlexAttention's score of one pair: (b, h, q_idx, kv_idx, t) -> B as a tensor; t is the pair's
#: column in the call's descending distances
PointScore = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class HandGradient:
    """A term's block maps with their gradient by hand, for one call (`ScoreTerm.hand_gradient`).

    `block` builds a block's map and what its backward reads; `backward` adds the gradient of Σ
    grad ∘ map onto the term's tensors' gradients (`grads`, aligned with `ScoreTerm.tensors`) and
    its parameters' (`param_grads`, aligned with `ScoreTerm.parameters`; None: not wanted), and
    returns what it adds to the attention's dS (a term that reads s·q·kᵀ) or None; `finish` runs
    once after the last block."""

    def block(
        self,
        call: AttentionCall,
        block: QueryBlock,
        q: Tensor | None,
        k: Tensor | None,
        backward: bool = False,
    ) -> tuple[Tensor, Any]:
        """(the block's map without autograd, what `backward` reads: `backward` only)."""
        raise NotImplementedError

    def backward(
        self,
        call: AttentionCall,
        block: QueryBlock,
        state: Any,
        grad: Tensor,
        grads: list[Tensor | None],
        param_grads: list[Tensor | None],
        q: Tensor | None,
        grad_q: Tensor | None,
    ) -> Tensor | None:
        raise NotImplementedError

    def finish(self, param_grads: list[Tensor | None]) -> None:
        """After the last block (default: nothing left to add)."""


class ScoreTerm:
    """One additive score term in the forms it can supply (module docstring). Subclasses set
    `name` and implement `block`; every other form is optional (None: not supplied)."""

    #: its key in RelPosAttention.score_terms (the sum adds the terms in the call's order)
    name: ClassVar[str] = "term"
    #: the optional forms it supplies, in the planner's vocabulary (relpos_ablate/planner.py):
    #: key_offsets, band, hand; `content`: its map reads the block's queries and keys over their
    #: whole rows (no key tiles, no FlexAttention), which `block` and `hand_gradient` then get
    forms: ClassVar[frozenset[str]] = frozenset()
    #: the query scale λ multiplies it (False: it reads the scaled content query already)
    scaled: ClassVar[bool] = True
    #: its point form may be differentiated by compiled FlexAttention
    point_gradient_trusted: ClassVar[bool] = True

    #: per-call tensors it was built from under autograd
    tensors: tuple[Tensor, ...] = ()

    @property
    def reads_content(self) -> bool:
        return "content" in self.forms

    def parameters(self) -> Iterator[Tensor]:
        """Module parameters its forms read directly."""
        return iter(())

    def with_tensors(self, tensors: tuple[Tensor, ...]) -> ScoreTerm:
        """The same term built on other tensors (aligned with `tensors`)."""
        return self

    def block(
        self,
        call: AttentionCall,
        block: QueryBlock,
        q: Tensor | None = None,
        k: Tensor | None = None,
    ) -> Tensor:
        """The block's map [B or 1, H, L_b, K_b]; q [B, H, L_b, dh] and k [B, H, K_b, dh] (no
        sinks) for a term that reads content."""
        raise NotImplementedError

    def hand_gradient(self, call: AttentionCall, trained: bool) -> HandGradient | None:
        """Its maps with their gradient by hand for this call (`trained`: its parameters need
        gradients), or None: autograd through `block`."""
        return None

    def key_offsets(self, call: AttentionCall) -> Tensor | None:
        """e [B or 1, H, K] float64 with B_ij = e_j - e_i' on the call's causal pairs, or None."""
        return None

    def point(self, call: AttentionCall, compiled: bool) -> PointScore | None:
        """B of one pair for FlexAttention (`compiled`: pointwise ops only), or None."""
        return None

    def band_width(self, call: AttentionCall, q: Tensor, k: Tensor) -> int | None:
        """D of a causal call: from distance D on, each query's B is one constant (its block form
        is then taken minus that constant where call.far_from is set), or None."""
        return None


class TermScheme(Part):
    """A scheme that adds a score term: built once per attention layer (`build`), it makes its
    term each forward from the keys' layer inputs [memory; x] (`term`; None: none this forward).
    A part (core/parts.py): it may use the parts' other hooks too. Register it with
    `@register_term("name")` (config/registry/builtins.py) and switch it on with
    `model.attention.term_schemes: [name]`; its formula and forms live in its own file
    (docs/extending/content-term.md)."""

    #: the ScoreTerm class it makes (its `forms` are the scheme's, for the planner)
    Term: ClassVar[type[ScoreTerm]] = ScoreTerm
    #: the attribute the attention keeps it under (its parameters' state-dict keys); None: the
    #: registered name
    attribute: ClassVar[str | None] = None

    @classmethod
    def build(cls, d_model: int, n_heads: int, d_head: int, config: Any) -> TermScheme:
        """The scheme of one attention layer (config: its AttentionConfig)."""
        return cls(d_model, n_heads, d_head, config)

    def term(self, keys_input: Tensor, key_padding_mask: Tensor | None) -> ScoreTerm:
        """This forward's term, from the keys' layer inputs [B, K, d_model] (memory first) and key
        padding [B, K] (True: padded) or None."""
        raise NotImplementedError


def needs_gradient(term: ScoreTerm) -> bool:
    """Whether a tensor or parameter of the term needs a gradient (under autograd)."""
    return torch.is_grad_enabled() and any(
        t.requires_grad for t in (*term.tensors, *term.parameters())
    )
