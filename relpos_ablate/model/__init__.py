"""The model layer: RelPosAttention (one module for every scheme) and TransformerLM around it."""

# first: before torch starts its intra-op threads
from relpos_ablate.model import denormals  # noqa: F401

# isort: split

from relpos_ablate.model.attention import RelPosAttention
from relpos_ablate.model.core.options import AttentionOptions, SharedParameters
from relpos_ablate.model.core.terms import HandGradient, ScoreTerm, TermScheme
from relpos_ablate.model.lm import TransformerLM
from relpos_ablate.model.schemes import (
    BiasScheme,
    alibi_slopes,
    build_bias,
    register_bias,
    t5_bucket,
)

__all__ = [
    "AttentionOptions",
    "BiasScheme",
    "RelPosAttention",
    "SharedParameters",
    "HandGradient",
    "ScoreTerm",
    "TermScheme",
    "TransformerLM",
    "alibi_slopes",
    "build_bias",
    "register_bias",
    "t5_bucket",
]
