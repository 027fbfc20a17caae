"""Position schemes: bias types (one module per family; names in relpos_ablate/config/registry.py),
sinusoids and RoPE."""

from relpos_ablate.config.registry import register_bias
from relpos_ablate.model.position.alibi import alibi_slopes
from relpos_ablate.model.position.base import BiasScheme, bias_schemes, build_bias
from relpos_ablate.model.position.rope import (
    RopeScaling,
    rope_frequencies,
    rotate,
    rotate_queries_keys,
    xpos_decay,
)
from relpos_ablate.model.position.sinusoid import sinusoid
from relpos_ablate.model.position.tables import t5_bucket

__all__ = [
    "BiasScheme",
    "RopeScaling",
    "alibi_slopes",
    "bias_schemes",
    "build_bias",
    "register_bias",
    "rope_frequencies",
    "rotate",
    "rotate_queries_keys",
    "sinusoid",
    "t5_bucket",
    "xpos_decay",
]
