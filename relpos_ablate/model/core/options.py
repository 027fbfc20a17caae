"""What a forward call of the attention is given besides its input: this call's options
(`AttentionOptions`: an evaluation setting's window, clamp, positions, key padding) and the
parameters a model shares across its layers (`SharedParameters`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor, nn

from relpos_ablate.model.core.geometry import StatisticsSink

if TYPE_CHECKING:
    from relpos_ablate.model.core.bias import BiasScheme
    from relpos_ablate.model.schemes.rope import RopeScaling


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """Options of one forward call (e.g. an evaluation setting); randomized draws differ by
    layer."""

    clamp_len: int | None = None
    """Distances beyond this share R_clamp in terms b/d (None: the config's clamp_len)."""
    window: int | None = None
    """Causal only: query i' sees key j iff 0 <= i' - j < window (itself and window - 1 earlier
    keys). Transformer-XL's same_length is window = mem_len."""
    key_padding_mask: Tensor | None = None
    """[B, M + L], True at keys no query may see."""
    document_ids: Tensor | None = None
    """[B, M + L] int, the document of every key (memory first, then this segment; the queries are
    the last L): a query sees only the keys of its own document (packed documents, data.documents
    packed_reset). Equal ids = one document, each document's tokens consecutive. None: one
    stream."""
    positions: Tensor | None = None
    """[M + L] positions of the keys (memory first, then this segment; the queries are the last L),
    shared by the batch, as the encodings read them: RoPE's angles, every bias and terms b/d at the
    distance q_pos - k_pos. Visibility stays by index. None: consecutive, 0 .. M + L - 1."""
    distances: Tensor | None = None
    """[M + L] d_0 .. d_(M+L-1): the distance the relative encodings (every bias, terms b/d, Shaw's
    tables) read at key-index offset r = i' - j, d_r for r >= 0 and -d_(-r) for r < 0 (Ruoss et
    al.'s randomized relative encodings draw them); the per-distance tensors keep their strided
    layout. RoPE and the absolute tables still read `positions`. None: the distance of the
    positions."""
    statistics: StatisticsSink | None = None
    """Where this call adds its attention statistics (entropy, sink mass, distances:
    diagnostics.py); the probabilities are then computed per query block (no fused kernel). None: no
    statistics."""
    rope_scaling: RopeScaling | None = None
    """RoPE extended to a longer context (position interpolation, NTK, YaRN; an evaluation setting's
    rope_scaling). None: the trained frequencies."""

    def __post_init__(self):
        for name in ("clamp_len", "window"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: {value} is out of range; use an integer >= 1 or None")


@dataclass(frozen=True, eq=False)
class SharedParameters:
    """Parameters a model shares across its layers (share_uv, share_bias); None: each layer owns its
    own."""

    content_bias_u: nn.Parameter | None = None
    position_bias_v: nn.Parameter | None = None
    bias_scheme: BiasScheme | None = None
