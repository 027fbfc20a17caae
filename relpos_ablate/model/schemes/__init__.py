"""Every scheme, one file each (names in relpos_ablate/config/registry/builtins.py): the bias types,
the score terms (fox.py, cope.py), RoPE, the sinusoid, sinks, the temperature, the schemes that read
the scores and Transformer-XL's R (xl.py). The interfaces they implement are in
relpos_ablate/model/core/ (a bias: core/bias.py; a score term: core/terms.py), exported here with
the decorators that register them."""

from relpos_ablate.config.registry import register_bias, register_term
from relpos_ablate.model.core.bias import BiasScheme, bias_schemes, build_bias
from relpos_ablate.model.core.terms import ScoreTerm, TermScheme
from relpos_ablate.model.schemes.alibi import alibi_slopes
from relpos_ablate.model.schemes.rope import (
    RopeScaling,
    rope_frequencies,
    rotate,
    rotate_queries_keys,
    xpos_decay,
)
from relpos_ablate.model.schemes.sinusoid import sinusoid
from relpos_ablate.model.schemes.tables import t5_bucket

__all__ = [
    "BiasScheme",
    "RopeScaling",
    "ScoreTerm",
    "TermScheme",
    "alibi_slopes",
    "bias_schemes",
    "build_bias",
    "register_bias",
    "register_term",
    "rope_frequencies",
    "rotate",
    "rotate_queries_keys",
    "sinusoid",
    "t5_bucket",
    "xpos_decay",
]
