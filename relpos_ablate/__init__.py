"""relpos-ablate: ablate relative position encodings in attention (Transformer-XL terms a/b/c/d,
bias-type encodings, absolute and rotary baselines), trained and evaluated with PyTorch Lightning."""

from relpos_ablate.config import AttentionConfig, ConfigError, ModelConfig, RunConfig
from relpos_ablate.model import RelPosAttention, TransformerLM

__all__ = ["AttentionConfig", "ConfigError", "ModelConfig", "RelPosAttention", "RunConfig", "TransformerLM", "collect"]


def __getattr__(name):
    # collect pulls in pandas and scipy: import it only when asked for
    if name == "collect":
        from relpos_ablate.analysis.collect import collect

        return collect
    raise AttributeError(f"module 'relpos_ablate' has no attribute {name!r}")
__version__ = "0.1.0"
