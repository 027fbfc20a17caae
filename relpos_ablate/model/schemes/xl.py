"""Transformer-XL's relative position vectors R_d, their projection W_R R_d per head (terms b
and d), the learned table of Shaw et al. (rel='learned') and the per-head curves the plots read
(`bias_curve`): the part of RelPosAttention that turns distances into tensors
(docs/schemes/xl-terms.md). A mixin: the parameters (r_net, r_table, value_table, position_bias_v,
bias_scheme) are the attention's own, so that their state-dict keys stay as they are."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from relpos_ablate.model.schemes.sinusoid import sinusoid
from relpos_ablate.model.schemes.tables import table_row


class RelativePositions:
    """R_d, W_R R_d and the curves of term d and the bias, for a RelPosAttention."""

    def table_row(self, distances: Tensor, clamp: int) -> Tensor:
        """Rows of the learned R (and Shaw value) table for distances [n], clipped at clamp <=
        clamp_len."""
        if clamp > self.config.clamp_len:
            raise ValueError(
                f"clamp_len: {clamp} exceeds the learned table (rel='learned', "
                f"clamp_len={self.config.clamp_len})"
            )
        return table_row(distances, clamp, self.config.clamp_len, self.config.causal)

    def relative_vectors(self, distances: Tensor, clamp_len: int | None = None) -> Tensor:
        """R_d for distances [n] -> [n, d_model]; distances beyond clamp_len share R_clamp."""
        clamp = clamp_len if clamp_len is not None else self.config.clamp_len
        if self.config.rel == "learned":
            return self.r_table[self.table_row(distances, clamp)]
        d = distances if clamp is None else distances.clamp(-clamp, clamp)
        return sinusoid(d, self.d_model).to(self.out_net.weight.dtype)

    def projected_relative(
        self, distances: Tensor, clamp_len: int | None = None, scale: float = 1.0
    ) -> Tensor:
        """scale·W_R R_d per head: [n] -> [H, n, dh], a view of the [n, H·dh] product (the scale
        multiplies W_R, not the product: one [n, H·dh] tensor in memory, and its transposed view is
        what the kernels' products read)."""
        # (n, H·dh)
        r = F.linear(self.relative_vectors(distances, clamp_len), self.r_net.weight * scale)
        return r.view(-1, self.n_heads, self.d_head).transpose(0, 1)  # (n, H, dh) -> (H, n, dh)

    def _term_d(self, rel_keys: Tensor) -> Tensor:
        """v·(s·W_R R_d) per head and distance: rel_keys [H, n, dh] -> [H, n]."""
        return torch.einsum("hd,hnd->hn", self.position_bias_v, rel_keys)

    def bias_curve(
        self, distances: Tensor, source: str = "bias", clamp_len: int | None = None
    ) -> Tensor:
        """Additive score per head at distances i - j: [n] -> [H, n].

        source='bias': the bias-type encoding (as added to the scores); source='d': term d, s·v·W_R
        R_d.
        """
        distances = torch.as_tensor(distances, device=self.out_net.weight.device)
        if source == "bias":
            if self.bias_scheme is None:
                raise ValueError(
                    "this attention has no bias (bias='none'); try source='d' for term d"
                )
            return self.bias_scheme.curve(distances) * self.bias_scale
        if source == "d":
            if self.position_bias_v is None:
                raise ValueError(
                    f"term d is off (terms={self.config.terms!r}); no v·W_R R curve to show"
                )
            return self._term_d(self.projected_relative(distances, clamp_len, self.scale))
        raise ValueError(f"source: {source!r} is not allowed; choose 'bias' or 'd'")
