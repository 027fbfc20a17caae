"""Position schemes: bias types (one module per family; names in relpos_ablate/config/registry.py) and sinusoids."""

from relpos_ablate.config.registry import register_bias
from relpos_ablate.model.position.alibi import alibi_slopes
from relpos_ablate.model.position.base import BiasScheme, build_bias
from relpos_ablate.model.position.sinusoid import rope_rotate, sinusoid
from relpos_ablate.model.position.tables import t5_bucket

__all__ = ["BiasScheme", "alibi_slopes", "build_bias", "register_bias", "rope_rotate", "sinusoid", "t5_bucket"]
