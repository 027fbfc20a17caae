"""The interface of a scheme that acts on the attention around its score sum: a `Part`.

A score term (core/terms.py) adds to the scores; a part may instead, or also, act at the other
points of one attention call, each an optional hook (the default leaves the call as it is):

- `keys_input(keys_input, n_mem, documents)`: the layer's input [memory; x] before the projections
  (Canon's causal convolution reads the memory's last tokens, and stops at a packed document's
  first).
- `queries_keys(q, k, at)`: q [B, H, L, dh] and k [B, H, K, dh] after the projections, before the
  kernel (RoPE, QK-norm, PoPE, MLA's decoupled rotary key, temperature tuning), in the order of
  the parts' `stage` (RoPE's rotation is stage 1: a part at 0 acts before it, at 2 after it).
- `sink_slots()`: key and value slots [H, S, dh] every query sees besides its keys, carrying no
  position (learned sinks; the sink logit's zero slot).
- `term(keys_input, key_padding_mask)`: a score term (core/terms.py), or None.
- `output(out, x)`: the attention's output per head [B, H, L, dh] before the output projection,
  from the layer's input x [B, L, d_model] (a gate).

A part is one file in model/schemes/, one line in config/registry/builtins.py (the field that
switches it on) and its options there, torch-free; the attention builds it once per layer under its
attribute and calls its hooks (docs/extending/content-term.md)."""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from relpos_ablate.model.core.placement import Placement


class Where(NamedTuple):
    """What a q/k transform may read: where queries and keys sit, the evaluation's RoPE scaling
    (or None), the layer's inputs [memory; x], and the positions temperature tuning reads (a
    chunked layer's, or None)."""

    placement: Placement
    rope_scaling: Any = None
    keys_input: Tensor | None = None
    tuned_positions: Tensor | None = None


class Part(nn.Module):
    """A scheme acting on one attention layer (module docstring): build it with `build`, override
    the hooks it uses."""

    #: where `queries_keys` acts relative to RoPE's rotation (stage 1)
    stage: float = 1.0
    #: the ScoreTerm class its `term` makes, or None (the planner reads its forms)
    Term: ClassVar[type | None] = None
    #: the attribute the attention keeps it under (its parameters' state-dict keys); None: the
    #: registered name
    attribute: ClassVar[str | None] = None

    @classmethod
    def build(cls, d_model: int, n_heads: int, d_head: int, config: Any) -> Part:
        """The part of one attention layer (config: its AttentionConfig)."""
        return cls(d_model, n_heads, d_head, config)

    def keys_input(self, keys_input: Tensor, n_mem: int, documents: Tensor | None) -> Tensor:
        """[B, K, d_model] -> [B, K, d_model]; the first n_mem rows are the memory's; documents [B,
        K]: packed documents' ids (a token mixing its neighbours must stop at its document's
        first), or None."""
        return keys_input

    def queries_keys(self, q: Tensor, k: Tensor, at: Where) -> tuple[Tensor, Tensor]:
        return q, k

    def sink_slots(self) -> tuple[Tensor, Tensor] | None:
        """(keys, values) [H, S, dh], or None."""
        return None

    def term(self, keys_input: Tensor, key_padding_mask: Tensor | None) -> Any:
        """This forward's ScoreTerm from the keys' layer inputs, or None."""
        return None

    def output(self, out: Tensor, x: Tensor) -> Tensor:
        return out


class Slots(NamedTuple):
    """The sink slots of a layer, every part's together: keys and values [H, S, dh]."""

    keys: Tensor
    values: Tensor

    @staticmethod
    def of(parts: list[Part]) -> Slots | None:
        slots = [s for s in (p.sink_slots() for p in parts) if s is not None]
        if not slots:
            return None
        return Slots(torch.cat([k for k, _ in slots], 1), torch.cat([v for _, v in slots], 1))

    def prepend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """[B, H, K, dk] keys and [B, H, K, dh] values -> [B, H, S + K, ...], the slots first (their
        keys padded with zeros to the keys' width dk, where a part widened q and k: PoPE)."""
        b = k.shape[0]
        return (
            torch.cat([self.widened(k.shape[-1]).to(k.dtype).expand(b, -1, -1, -1), k], dim=2),
            torch.cat([self.values.to(v.dtype).expand(b, -1, -1, -1), v], dim=2),
        )

    def logits(self, q_content: Tensor, scale: float) -> Tensor:
        """s·q_content·k_slot: [B, H, L, dk] -> [B, H, L, S]."""
        keys = self.widened(q_content.shape[-1]).to(q_content.dtype)
        return (q_content @ keys.transpose(-1, -2)) * scale

    def widened(self, width: int) -> Tensor:
        """The slots' keys [H, S, width], zeros after their own channels."""
        return torch.nn.functional.pad(self.keys, (0, width - self.keys.shape[-1]))
