"""Model and attention configs. Field docstrings are the documentation (shown by `--help`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

#: The built-in values of `bias`, from the registry (config/registry/builtins.py);
#: `bias_types()` adds the schemes registered at run time with register_bias.
from relpos_ablate.config.attention import AttentionConfig
from relpos_ablate.config.base import ConfigError, check_choice, check_range
from relpos_ablate.config.schedule import INPUT_POSITIONS, LayerKind, check_pattern, layer_overrides
from relpos_ablate.config.scheme_checks import (
    check_widths,
)

NORMS = ("pre", "post")
EMBED_SCALES = ("auto", "sqrt_d_model", "none")
#: Absolute baselines whose published code multiplies the token embedding by sqrt(d_model) ('auto').
SCALED_EMBEDDING_BY_DEFAULT = ("sinusoid", "learned_per_layer")


@dataclass(frozen=True)
class ModelConfig:
    """The language model around the attention: Transformer-XL style, with segment memory."""

    vocab_size: int = 0
    """Token vocabulary; 0 means 'take it from the data' (run configs fill it in)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of layers."""
    n_heads: int = 4
    """Attention heads per layer."""
    d_head: int = 32
    """Width of one head."""
    d_inner: int = 512
    """Hidden width of the feed-forward block."""
    dropout: float = 0.1
    """Dropout on embeddings, attention output and feed-forward."""
    attn_dropout: float = 0.0
    """Dropout on attention probabilities."""
    norm: str = "pre"
    """LayerNorm placement: 'pre' (GPT-2 style) or 'post' (Transformer-XL)."""
    tie_weights: bool = True
    """Output projection shares the token embedding."""
    embed_scale: str = "auto"
    """Multiplier of the token embedding (N(0, 0.02)) at the input; tied output weights stay
    unscaled. 'sqrt_d_model' | 'none' (x1) | 'auto': each absolute baseline's published default.
    sinusoid: sqrt(d_model) (Vaswani et al. 2017 §3.4 "we multiply those weights by sqrt(d_model)";
    Transformer-XL's code, AdaptiveEmbedding emb_scale = d_proj**0.5), else the fixed sinusoid
    (entries in [-1, 1]) swamps the embedding, ~35x its norm at d_model 410. learned_per_layer:
    sqrt(d_model) (Transformer-XL's code for its Al-Rfou baseline, attn_type 3). learned: x1 (GPT-2:
    wte N(0, 0.02), wpe N(0, 0.01), unscaled). none, rope and the relative schemes: x1 (GPT-2, T5,
    GPT-NeoX); nothing is added at the input, so the scale only sizes the embedding against the
    residual branches (Transformer-XL's and fairseq's code scale every model: 'sqrt_d_model' matches
    them)."""
    mem_len: int = 0
    """Tokens of memory per layer carried from segment to segment (0: no recurrence)."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """Attention settings (see AttentionConfig); every layer's, unless layer_pattern gives a layer
    its own."""
    layer_kinds: tuple[LayerKind, ...] = ()
    """Named kinds of layer for layer_pattern, written as a mapping {name: fields}: e.g. {local:
    {encoding: rope, window: 64}, global: {encoding: nope}}. A kind is the model's attention with
    its encoding preset and its own fields on top (docs/schemes/schedules.md#layer-schedules)."""
    layer_pattern: tuple[str, ...] = ()
    """Per-layer attention: layer l uses word l mod len(pattern), a layer kind or an encoding preset
    (e.g. [rope, rope, rope, nope]: NoPE every 4th layer). A grid axis like any field:
    model.layer_pattern: [[rope], [rope, nope]]. []: every layer uses attention."""

    def __post_init__(self):
        check_range("vocab_size", self.vocab_size, low=0)
        for name in ("d_model", "n_layers", "n_heads", "d_head", "d_inner"):
            check_range(name, getattr(self, name), low=1)
        check_range("dropout", self.dropout, 0.0, 1.0)
        check_range("attn_dropout", self.attn_dropout, 0.0, 1.0)
        check_choice("norm", self.norm, NORMS)
        check_choice("embed_scale", self.embed_scale, EMBED_SCALES)
        check_range("mem_len", self.mem_len, low=0)
        if self.mem_len and self.attention.randomized:
            raise ConfigError(
                "mem_len",
                "randomized positions are drawn per segment, and memory would keep another "
                "draw's positions; use mem_len 0 (or positions: sequential)",
            )
        check_widths(self.attention, self.d_model, self.d_head)
        self._check_layers()
        if self.attention.absolute == "sinusoid" and self.d_model % 2:
            raise ConfigError(
                "d_model", f"sinusoid positions need an even d_model (got {self.d_model})"
            )

    def _check_layers(self) -> None:
        """Every layer's attention is valid; positions added at the input are the model's alone."""
        kinds = check_pattern(self.layer_pattern, self.layer_kinds)
        for word in dict.fromkeys(self.layer_pattern):
            where = (
                f"layer_kinds.{word}"
                if word in kinds
                else f"layer_pattern[{self.layer_pattern.index(word)}]"
            )
            try:
                attention = self._word_attention(word)
            except ConfigError as err:
                raise err.under(where) from None
            if attention.absolute != self.attention.absolute and INPUT_POSITIONS & {
                attention.absolute,
                self.attention.absolute,
            }:
                raise ConfigError(
                    where,
                    f"absolute {attention.absolute!r}: positions added at the model's input are "
                    "the model's (model.attention.absolute), not a layer's; use rope, "
                    "learned_per_layer or none in a layer",
                )
            check_widths(attention, self.d_model, self.d_head)

    def _word_attention(self, word: str) -> AttentionConfig:
        """The attention a pattern word stands for: the model's, with the kind's or the preset's
        fields on top."""
        kinds = {kind.name: kind for kind in self.layer_kinds}
        return dataclasses.replace(self.attention, **layer_overrides(word, kinds))

    def layer_attention(self, index: int) -> AttentionConfig:
        """The attention settings of layer `index` (the model's without a layer_pattern)."""
        word = self.layer_word(index)
        return self.attention if word is None else self._word_attention(word)

    def layer_word(self, index: int) -> str | None:
        """The pattern word (kind or preset) of layer `index`; None without a layer_pattern."""
        return self.layer_pattern[index % len(self.layer_pattern)] if self.layer_pattern else None

    @property
    def layer_attentions(self) -> tuple[AttentionConfig, ...]:
        """Every layer's attention settings, in order."""
        return tuple(self.layer_attention(i) for i in range(self.n_layers))

    @property
    def embedding_multiplier(self) -> float:
        """The factor `embed_scale` stands for, 'auto' resolved by the absolute baseline."""
        scale = self.embed_scale
        if scale == "auto":
            scale = (
                "sqrt_d_model" if self.attention.absolute in SCALED_EMBEDDING_BY_DEFAULT else "none"
            )
        return math.sqrt(self.d_model) if scale == "sqrt_d_model" else 1.0
