"""relpos-ablate: ablate relative position encodings in attention (Transformer-XL terms a/b/c/d,
bias-type encodings, absolute and rotary baselines), trained and evaluated with PyTorch Lightning.

The configs import at once; the model (torch) and `collect` (pandas, scipy) load on first use, so
commands that only read run directories (`grid` reruns, `status`) start fast.
"""

from importlib import metadata as _metadata

from relpos_ablate.config import AttentionConfig, ConfigError, ModelConfig, RunConfig
from relpos_ablate.config.registry import register_bias, register_term

__all__ = [
    "AttentionConfig",
    "ConfigError",
    "ModelConfig",
    "RelPosAttention",
    "RunConfig",
    "TransformerLM",
    "collect",
    "load_run",
    "register_bias",
    "register_term",
]
try:  # the installed distribution's version: pyproject.toml is its one source
    __version__ = _metadata.version("relpos-ablate")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown"

_LAZY = {
    "RelPosAttention": "relpos_ablate.model.attention",
    "TransformerLM": "relpos_ablate.model.lm",
    "collect": "relpos_ablate.analysis.collect",
    "load_run": "relpos_ablate.train.run",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'relpos_ablate' has no attribute {name!r}")
