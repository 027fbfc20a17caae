"""Evaluation-time options: clamp_len overrides reach keys and Shaw values alike, and a learned
table asked for a longer clamp is rejected when the run config is validated.
Run: pytest tests/test_attention_eval_options.py -q"""

import pytest
import torch

from conftest import randomize
from reference import reference_attention
from relpos_ablate import AttentionConfig, ConfigError, RelPosAttention
from relpos_ablate.config import load_run_config


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_shaw_values_honour_the_evaluation_clamp(causal):
    """Keys (term b) and values (a^V) index the same clipped distance: clamp 1 at evaluation changes both."""
    attn = RelPosAttention(16, 2, 8, AttentionConfig(terms="ab", rel="learned", clamp_len=3, shaw_values=True,
                                                     causal=causal)).double()
    randomize(attn, 4)
    gen = torch.Generator().manual_seed(5)
    x, mems = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64), torch.randn(2, 3, 16, generator=gen, dtype=torch.float64)
    out, _ = attn(x, mems, clamp_len=1)
    ref, _ = reference_attention(attn, x, mems, clamp_len=1)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-9)


def test_learned_table_is_checked_against_evaluation_clamps_at_validation():
    base = ["model.attention.terms=ab", "model.attention.rel=learned", "model.attention.clamp_len=4"]
    load_run_config(None, [*base, "eval.settings=[{segment_len: 8, clamp_len: 4}]"])  # within the table: fine
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [*base, "eval.settings=[{segment_len: 8}, {segment_len: 8, clamp_len: 6}]"])
    text = str(err.value)
    assert text.startswith("eval.settings[1].clamp_len: 6 ") and "model.attention.clamp_len=4" in text
    assert "\n" not in text
    # a sinusoid R has no table: any clamp is allowed
    load_run_config(None, ["model.attention.clamp_len=4", "eval.settings=[{segment_len: 8, clamp_len: 40}]"])
