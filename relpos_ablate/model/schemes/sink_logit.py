"""A sink logit per head (gpt-oss's learned sinks; Megatron's `softmax_type: off-by-one |
learnable`; Miller's softmax_1): a scalar s_h that joins every row's softmax denominator with a
zero value,

    p_ij = exp(z_ij) / (exp(s_h) + Σ_j' exp(z_ij')),
    out_i = Σ_j p_ij v_j = out_i^softmax·σ(lse_i - s_h).

`sink_logit: off_by_one` fixes s_h = 0; `learned` learns s_h per layer and head (init 0). Unlike
the learned sink slots (`sinks`: a key and a value per slot, the logit s·q·k_sink read from the
query) it has no key and no value: the logit is the same for every query, and its mass goes
nowhere.

One mechanism on every kernel: a slot whose key and value are zero (logit 0, nothing added to the
output) joins the keys, and the score term -s_h is added to every real key's score. A softmax
does not change when a row is shifted, so [z_ij, s_h] and [z_ij - s_h, 0] give the same weights.
The shift is not multiplied by the query scale (a temperature scales z, not s_h); log-n scaling
counts the slot as one of the keys a query sees.
docs/schemes/attention-plumbing.md#sink-logit.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from relpos_ablate.model.core.terms import ScoreTerm, TermScheme


class SinkLogit(TermScheme):
    """s_h [H] of one layer (`logit`; None for off_by_one) and the zero slot."""

    attribute = "sink_logit"

    def __init__(self, d_model: int, n_heads: int, d_head: int, config):
        super().__init__()
        learned = config.sink_logit == "learned"
        self.logit = nn.Parameter(torch.zeros(n_heads)) if learned else None
        self.register_buffer("zero", torch.zeros(n_heads, 1, d_head), persistent=False)

    def sink_slots(self) -> tuple[Tensor, Tensor]:
        return self.zero, self.zero

    def term(self, keys_input: Tensor, key_padding_mask: Tensor | None) -> SinkShift | None:
        return None if self.logit is None else SinkShift(self.logit)


class SinkShift(ScoreTerm):
    """-s_h on every pair of head h, in every form: a block's map and one pair's."""

    name = "sink_logit"
    forms = frozenset({"sinks"})
    scaled = False

    def __init__(self, logit: Tensor):
        self.logit = logit

    def parameters(self):
        return iter((self.logit,))

    def block(self, call, block, q=None, k=None) -> Tensor:
        dtype = torch.promote_types(call.dtype, torch.float32)
        shift = -self.logit.to(dtype)[None, :, None, None]  # (1, H, 1, 1)
        return shift.expand(1, -1, block.i1 - block.i0, block.n_keys - block.k0).contiguous()

    def point(self, call, compiled: bool):
        shift = -self.logit.to(torch.promote_types(call.dtype, torch.float32))
        return lambda b, h, q_idx, kv_idx, t: shift[h]


SinkLogit.Term = SinkShift
