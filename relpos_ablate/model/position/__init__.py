"""Position schemes: bias types (one module per family, registered by name) and sinusoids."""

from relpos_ablate.model.position import alibi, kerple, mlp, tables  # noqa: F401  (register the schemes)
from relpos_ablate.model.position.alibi import alibi_slopes
from relpos_ablate.model.position.base import BIAS_REGISTRY, BiasScheme, build_bias, register
from relpos_ablate.model.position.sinusoid import rope_rotate, sinusoid
from relpos_ablate.model.position.tables import t5_bucket

__all__ = [
    "BIAS_REGISTRY", "BiasScheme", "alibi_slopes", "build_bias", "register", "rope_rotate", "sinusoid", "t5_bucket",
]
