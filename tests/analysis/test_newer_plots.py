"""Bias/decay plots of the newer schemes: FoX's decay read from a sample (mean D per distance and
each head's mean log-gate), xPos's per-pair decay, Sandwich's per-head curve; values compared with
the papers' formulas computed here. Run: pytest tests/analysis/test_newer_plots.py -q"""

import math

import numpy as np
import pytest
import torch

from fixtures.plots import fake_sampler, lines, tiny_model
from relpos_ablate.analysis import plots
from relpos_ablate.analysis.figures import bias_figure, decay_curves, inspect_sample
from relpos_ablate.model.schemes import alibi_slopes


def test_fox_with_constant_gates_plots_alibis_lines_and_its_slopes():
    """Gates e^(-m_h) for every token: the sample's mean decay at distance r is -m_h·r, the legend's
    mean log-gate -m_h, in every layer (with memory filled first)."""
    config, model = tiny_model(
        "model.attention.terms=a", "model.attention.forget_gate=true", "model.mem_len=4"
    )
    slopes = torch.tensor(alibi_slopes(4))
    with torch.no_grad():
        for attn in model.attention_layers():
            attn.forget_gate.proj.weight.zero_()
            attn.forget_gate.proj.bias.copy_(-torch.log(torch.expm1(slopes)))
    fig = plots.run_figure("bias", config, model, "fox", 0, 0, fake_sampler)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == [
        "FoX decay on a sample, layer 0",
        "FoX decay on a sample, layer 1",
    ]
    for ax in panels:
        for h, line in enumerate(lines(ax)):
            r = np.asarray(line.get_xdata())
            assert list(r) == list(range(12))  # the sample's distances: segment 8 + memory 4
            assert line.get_ydata() == pytest.approx(-slopes[h].item() * r, abs=1e-5)
            assert line.get_label() == f"head {h}: mean log f = {-slopes[h].item():.2f}"


def test_fox_curves_average_the_sample_per_distance():
    """With data-dependent gates the curve at r is the mean over the sample's pairs at distance r of
    D_ij = Σ_{l=j+1..i} log f_l, and at r = 1 the mean log-gate."""
    config, model = tiny_model(
        "model.attention.terms=a", "model.attention.forget_gate=true", seed=3
    )
    details, n_mem = inspect_sample(model, fake_sampler(config, 8), 8, 0)
    curves = decay_curves(model, details, n_mem)
    decay = details["terms"][1]["decay"][0].double()  # (H, L, K)
    mean, slope = curves[id(model.attention_layers()[1])]
    for r in (0, 1, 5):
        pairs = [decay[:, i, i - r] for i in range(r, 8)]
        np.testing.assert_allclose(mean[:, r], torch.stack(pairs).mean(0).numpy(), rtol=1e-9)
    np.testing.assert_allclose(slope, mean[:, 1])


def test_xpos_plots_each_pairs_decay_zeta_to_the_distance_over_b():
    _, model = tiny_model(
        "model.attention.terms=a",
        "model.attention.absolute=rope",
        "model.attention.xpos_scale_base=16",
    )
    (ax,) = [ax for ax in bias_figure(model, 32, 8).axes if ax.get_visible()]
    assert ax.get_title() == "xPos decay per rotary pair, all layers"
    drawn = lines(ax, "pair")
    # d_head 8: 4 pairs
    assert [line.get_label().split(" ")[1] for line in drawn] == ["0", "1", "2", "3"]
    for p, line in enumerate(drawn):
        zeta = (2 * p + 0.4 * 8) / (1.4 * 8)
        assert line.get_ydata() == pytest.approx(zeta ** (np.arange(33) / 16))


def test_sandwich_plots_its_head_divided_curves():
    _, model = tiny_model("model.attention.terms=a", "model.attention.bias=sandwich")
    (ax,) = [ax for ax in bias_figure(model, 16, 8).axes if ax.get_visible()]
    inner = [sum(math.cos(r * 10000 ** (-2 * k / 8)) for k in range(1, 5)) - 4 for r in range(17)]
    for h, line in enumerate(lines(ax)):
        assert line.get_ydata() == pytest.approx(np.array(inner) / (8 * (h + 1) / 4), abs=1e-6)


def test_term_maps_show_foxs_decay_and_copes_term():
    config, model = tiny_model(
        "model.attention.terms=a",
        "model.attention.forget_gate=true",
        "model.attention.cope_positions=4",
    )
    fig = plots.run_figure("terms", config, model, "t", 0, 1, fake_sampler)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[-2:] == ["FoX decay D_ij", "CoPE s·q·e[p_ij]"]


def test_a_fox_bias_figure_without_a_sample_says_how_to_get_one():
    from relpos_ablate.config import ConfigError

    _, model = tiny_model("model.attention.terms=a", "model.attention.forget_gate=true")
    with pytest.raises(
        ConfigError, match=r"^decays: FoX's decay is read on a sample: pass decays=decay_curves"
    ):
        bias_figure(model, 16)
