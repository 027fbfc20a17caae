"""Figures: extrapolation curves from collect(), and bias curves / attention heatmaps / score-term
maps of tiny TransformerLMs. The plotted data are read back from the figures and compared with
values computed here from the papers' formulas (ALiBi slopes, T5 buckets, the XL sinusoid), not from
the code under test. Also `relpos-ablate plot` and its one-line errors.

Run: .venv/bin/python -m pytest tests/analysis/test_plots.py -q
"""

import math
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fixtures.plots import TINY, fake_sampler, lines, tiny_model
from fixtures.report_runs import make_grid, make_run, trained_results
from relpos_ablate.analysis import collect, plots
from relpos_ablate.analysis.figures import (
    attention_figure,
    bias_figure,
    inspect_sample,
    terms_figure,
)
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError, RunConfig, from_dict
from relpos_ablate.model import TransformerLM

PPL = {
    ("xl", 0): [10.0, 12.0],
    ("xl", 1): [11.0, 14.0],
    ("alibi", 0): [12.0, 12.5],
    ("alibi", 1): [12.2, 12.4],
}


def fake_loader(run_dir):
    """What load_run returns, built from the run dir's config.yaml (no checkpoint needed)."""
    config = from_dict(RunConfig, yaml.safe_load((run_dir / "config.yaml").read_text()))
    if (
        config.model.attention.bias == "none"
        and "d" not in config.model.attention.terms
        and config.seed == 7
    ):
        raise FileNotFoundError(f"{run_dir}/checkpoints/last.ckpt: no checkpoint")
    torch.manual_seed(config.seed)
    return config, TransformerLM(config.model).eval()


def vlines(ax, style):
    return sorted(
        float(line.get_xdata()[0]) for line in ax.get_lines() if line.get_linestyle() == style
    )


# ---------------------------------------------------------------- extrapolation


def test_extrapolation_lines_are_seed_means_with_std_bands(tmp_path):
    make_grid(tmp_path, PPL, lengths=(32, 128))
    fig = plots.extrapolation_figure(collect(tmp_path))
    ax = fig.axes[0]
    for enc in ("xl", "alibi"):
        (line,) = [ln for ln in ax.get_lines() if ln.get_label() == enc]
        assert list(line.get_xdata()) == [32, 128]
        expected = [statistics.mean(PPL[(enc, s)][k] for s in (0, 1)) for k in (0, 1)]
        assert list(line.get_ydata()) == pytest.approx(expected)
    bands = ax.collections
    assert len(bands) == 2
    lows = sorted(band.get_paths()[0].vertices[:, 1].min() for band in bands)
    expected_lows = sorted(
        min(
            statistics.mean(PPL[(e, s)][k] for s in (0, 1))
            - statistics.stdev([PPL[(e, s)][k] for s in (0, 1)])
            for k in (0, 1)
        )
        for e in ("xl", "alibi")
    )
    assert lows == pytest.approx(expected_lows)
    # training segment_len (make_grid)
    assert ax.get_xscale() == "log" and vlines(ax, ":") == [32.0]
    assert "ppl" in ax.get_ylabel() and "evaluation length" in ax.get_xlabel()


def test_a_run_trained_by_train_alone_is_named_by_its_dir_not_its_folder(tmp_path):
    run = make_run(
        tmp_path,
        ["train.segment_len=32"],
        results=[({"segment_len": 32}, {"ppl": 3.0}), ({"segment_len": 64}, {"ppl": 4.0})],
    )
    (run / "run.json").unlink()
    (tmp_path / "runs").mkdir()
    run = run.rename(tmp_path / "runs" / "mine")
    fig = plots.extrapolation_figure(collect(tmp_path / "runs"))
    assert "mine" in [
        line.get_label() for line in fig.axes[0].get_lines()
    ] and fig.get_suptitle().startswith("mine: ppl")
    assert plots.variant_label(collect(run).iloc[0], []) == "mine"


def test_save_extrapolation_writes_png_and_pdf(tmp_path):
    make_grid(tmp_path / "res", PPL, lengths=(32, 64))
    written, notes = plots.save_extrapolation(collect(tmp_path / "res"), tmp_path / "figs")
    assert [p.name for p in written] == ["extrapolation.png", "extrapolation.pdf"] and notes == []
    assert (
        written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        and written[1].read_bytes()[:5] == b"%PDF-"
    )
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == [
        "extrapolation.pdf",
        "extrapolation.png",
    ]


# ---------------------------------------------------------------- bias curves


def test_alibi_curves_follow_the_paper_slopes_and_the_shared_module_is_drawn_once():
    _, model = tiny_model("model.attention.terms=a", "model.attention.bias=alibi")
    fig = bias_figure(model, max_distance=32, train_len=8)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 1 and "shared" in visible[0].get_title()
    for h, line in enumerate(lines(visible[0])):
        slope = 2.0 ** (-8 * (h + 1) / 4)  # Press et al.: m_h = 2^(-8h/n), h = 1..n
        assert line.get_ydata() == pytest.approx(-slope * np.arange(33), abs=1e-6)
    _, per_layer = tiny_model(
        "model.attention.terms=a", "model.attention.bias=alibi", "model.attention.share_bias=false"
    )
    titles = [ax.get_title() for ax in bias_figure(per_layer, 32).axes if ax.get_visible()]
    assert titles == ["bias, layer 0", "bias, layer 1"]


def t5_bucket_reference(rp, num_buckets, max_distance):
    """T5's bidirectional bucket of relative_position = j - i, written from the paper's
    description."""
    nb = num_buckets // 2
    offset = nb if rp > 0 else 0
    n = abs(rp)
    exact = nb // 2
    if n < exact:
        return offset + n
    return offset + min(
        nb - 1, exact + int(math.log(n / exact) / math.log(max_distance / exact) * (nb - exact))
    )


def test_t5_bidirectional_curves_and_bucket_edges():
    _, model = tiny_model(
        "model.attention.terms=a",
        "model.attention.bias=t5",
        "model.attention.causal=false",
        "model.attention.num_buckets=16",
        "model.attention.max_distance=20",
    )
    fig = bias_figure(model, max_distance=24, train_len=8)
    ax = fig.axes[0]
    distances = np.arange(-24, 25)
    buckets = [t5_bucket_reference(-d, 16, 20) for d in distances]  # distance i - j = -(j - i)
    table = model.attention_layers()[0].bias_scheme.table.detach().numpy()  # (buckets, H)
    for h, line in enumerate(lines(ax)):
        assert list(line.get_xdata()) == list(distances)
        assert line.get_ydata() == pytest.approx(table[buckets, h])
    # the logarithmic buckets' edges, from where the exact ones (one distance each: 8 a side, 4 of
    # them exact) end
    positive = [
        d
        for d in range(4, 25)
        if t5_bucket_reference(-d, 16, 20) != t5_bucket_reference(-(d - 1), 16, 20)
    ]
    assert positive[0] == 4
    assert vlines(ax, "--") == sorted([float(d) for d in positive] + [-float(d) for d in positive])
    assert vlines(ax, ":") == [-8.0, 8.0]  # training attention length, both directions


def test_term_d_curve_matches_the_xl_formula_and_marks_the_clamp():
    config, model = tiny_model("model.attention.terms=abcd", "model.attention.clamp_len=6")
    fig = bias_figure(model, max_distance=16)
    d = np.minimum(np.arange(17), 6).astype(np.float64)
    inv_freq = 1.0 / 10000 ** (np.arange(0, 32, 2) / 32)
    # (n, D)
    r = np.concatenate([np.sin(d[:, None] * inv_freq), np.cos(d[:, None] * inv_freq)], axis=1)
    for layer, ax in enumerate(fig.axes):
        attn = model.attention_layers()[layer]
        w_r = attn.r_net.weight.detach().double().numpy()  # (H * dh, D)
        v = attn.position_bias_v.detach().double().numpy()  # (H, dh)
        projected = (r @ w_r.T).reshape(len(d), 4, 8)  # (n, H, dh)
        expected = np.einsum("hd,nhd->hn", v, projected) / math.sqrt(8)
        assert ax.get_title() == f"term d, layer {layer}"
        for h, line in enumerate(lines(ax)):
            assert line.get_ydata() == pytest.approx(expected[h], abs=1e-6)
        assert vlines(ax, "--") == [6.0]


def test_a_scheme_without_bias_is_a_clear_error():
    _, model = tiny_model("model.attention.terms=ac")
    with pytest.raises(
        ConfigError, match=r"has no bias curve: bias='none' and term d is off \(terms='ac'\)"
    ):
        bias_figure(model, 16)


# ---------------------------------------------------------------- attention and terms


def test_attention_heatmaps_are_the_probabilities_with_memory_columns():
    config, model = tiny_model("model.attention.terms=abcd", "model.mem_len=8")
    tokens = fake_sampler(config, 16)
    details, n_mem = inspect_sample(model, tokens, segment_len=8, mem_len=8)
    assert n_mem == 8
    with torch.no_grad():
        _, mems = model(tokens[:, :8], None, mem_len=8)
        expected = model.inspect(tokens[:, 8:], mems, mem_len=8)["probs"]  # per layer (1, H, 8, 16)
    fig = attention_figure(details, n_mem)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert len(panels) == 2 * 4
    for k, ax in enumerate(panels):
        image = np.ma.filled(ax.get_images()[0].get_array().astype(float), np.nan)  # (8, 16)
        layer, head = divmod(k, 4)
        want = expected[layer][0, head].numpy()
        seen = ~np.isnan(image)
        # query i sees 8 memory keys + i + 1
        assert seen.sum(1).tolist() == [9 + i for i in range(8)]
        assert image[seen] == pytest.approx(want[seen], abs=1e-6)
        assert np.nansum(image, axis=1) == pytest.approx(np.ones(8), abs=1e-5)
        assert vlines(ax, "-") == [7.5]  # the memory / segment border


def test_terms_figure_shows_only_the_enabled_terms_and_names_the_others_off():
    config, model = tiny_model("model.attention.terms=ac", "model.attention.bias=alibi")
    details, n_mem = inspect_sample(model, fake_sampler(config, 8), 8, 0)
    fig = terms_figure(details, layer=-1, head=2, n_mem=n_mem)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title()[:3] for ax in panels] == ["(a)", "(c)", "bia"]
    assert fig.get_suptitle().endswith("(terms b, d off)")
    _, only_a = tiny_model("model.attention.terms=a")
    details_a, _ = inspect_sample(only_a, fake_sampler(config, 8), 8, 0)
    single = terms_figure(details_a, layer=0, head=0, n_mem=0)
    assert [ax.get_title()[:3] for ax in single.axes if ax.get_title()] == ["(a)"]
    assert not any(ax.texts for ax in single.axes)  # no "term X is off" panels
    image = np.ma.filled(panels[0].get_images()[0].get_array().astype(float), np.nan)
    want = details["terms"][1]["a"][0, 2].numpy()
    assert np.isnan(image[np.triu_indices(8, 1)]).all()  # future keys are masked
    low = np.tril_indices(8)
    assert image[low] == pytest.approx(want[low])
    alibi = np.ma.filled(panels[2].get_images()[0].get_array().astype(float), np.nan)
    assert alibi[low] == pytest.approx(-(2.0**-6) * (low[0] - low[1]))  # head 2 of 4: slope 2^-6
    with pytest.raises(ConfigError, match=r"head: 4 is out of range; this model has heads 0..3"):
        terms_figure(details, layer=0, head=4, n_mem=0)


# ---------------------------------------------------------------- grids and the command


def bias_grid(root):
    make_run(
        root,
        [*TINY, "model.attention.terms=a", "model.attention.bias=alibi"],
        variant={"encoding": "alibi"},
        results=[({"segment_len": 8}, {"ppl": 3.0})],
    )
    make_run(
        root,
        [*TINY, "model.attention.terms=abcd"],
        variant={"encoding": "xl"},
        results=[({"segment_len": 8}, {"ppl": 2.0})],
    )
    nope = make_run(
        root,
        [*TINY, "model.attention.terms=a"],
        variant={"encoding": "nope"},
        results=[({"segment_len": 8}, {"ppl": 4.0})],
    )
    make_run(
        root,
        [*TINY, "model.attention.terms=a", "seed=3"],
        state="failed",
        variant={"encoding": "nope"},
    )
    return nope


def capture_figures(monkeypatch) -> dict:
    """plots.save_figure, recording each figure by its file stem's name."""
    figures_by_name, save = {}, plots.save_figure

    def recording(fig, stem, formats=("png", "pdf")):
        figures_by_name[Path(stem).name] = fig
        return save(fig, stem, formats)

    monkeypatch.setattr(plots, "save_figure", recording)
    return figures_by_name


def test_grid_gets_one_figure_per_run_plus_an_overview_and_skips_runs_without_bias(
    tmp_path, monkeypatch
):
    nope = bias_grid(tmp_path)
    df = collect(tmp_path)
    saved = capture_figures(monkeypatch)
    written, notes = plots.save_model_figures(
        df, "bias", tmp_path / "figs", formats=("png",), loader=fake_loader, sampler=fake_sampler
    )
    done = df[df["status"] == "done"].set_index("encoding")["run_id"]
    assert sorted(p.name for p in written) == sorted(
        [
            f"bias_encoding-alibi_seed-0_{done['alibi']}.png",
            f"bias_encoding-xl_seed-0_{done['xl']}.png",
            "bias_overview.png",
        ]
    )
    assert (
        len(notes) == 2 and notes[0].startswith(f"{nope}: skipped") and "no bias curve" in notes[0]
    )
    # the runs left out are counted in the title, their variants named under it
    overview = saved["bias_overview"]
    assert overview.get_suptitle() == (
        "bias: 2 runs (layer 0 or the shared module; seeds overlaid, one y scale per "
        "scheme); 1 not drawn\nno bias curve: encoding=nope"
    )
    assert (
        notes[1]
        == "bias_overview: left out: encoding=nope (seed 0): no bias curve: bias='none' and term "
        "d is off (terms='a'), no FoX gate, no xPos."
    )
    # no run id
    assert saved[f"bias_encoding-xl_seed-0_{done['xl']}"].get_suptitle() == "encoding=xl, seed=0"
    with pytest.raises(ConfigError, match=r"has no bias curve"):
        plots.save_model_figures(
            collect(nope), "bias", tmp_path / "one", loader=fake_loader, sampler=fake_sampler
        )
    written, _ = plots.save_model_figures(
        collect(nope),
        "attention",
        tmp_path / "one",
        formats=("png",),
        loader=fake_loader,
        sampler=fake_sampler,
    )
    assert written == [tmp_path / "one" / "attention.png"]


def test_bias_overview_overlays_seeds_and_shares_one_y_scale_per_scheme(tmp_path, monkeypatch):
    for encoding, overrides in {
        "alibi": ["model.attention.bias=alibi"],
        "t5": ["model.attention.bias=t5"],
        "t5_short": ["model.attention.bias=t5", "model.attention.max_distance=24"],
    }.items():
        for seed in (0, 1):
            make_run(
                tmp_path,
                [*TINY, "model.attention.terms=a", *overrides, f"seed={seed}"],
                variant={"encoding": encoding, "seed": seed},
                results=[({"segment_len": 8}, {"ppl": 3.0})],
            )
    saved = capture_figures(monkeypatch)
    plots.save_model_figures(
        collect(tmp_path),
        "bias",
        tmp_path / "figs",
        formats=("png",),
        loader=fake_loader,
        sampler=fake_sampler,
    )
    panels = [ax for ax in saved["bias_overview"].axes if ax.get_visible() and ax.get_lines()]
    assert [ax.get_title().split("\n")[0] for ax in panels] == [
        "encoding=alibi",
        "encoding=t5",
        "encoding=t5_short",
    ]
    for ax in panels:
        # not the vertical marks
        curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]
        assert [line.get_linestyle() for line in curves] == ["-"] * 4 + [
            "--"
        ] * 4  # 4 heads x 2 seeds
        assert ax.get_title().endswith("seeds 0, 1")
    assert panels[1].get_ylim() == panels[2].get_ylim()  # both t5: one scale
    assert panels[0].get_ylim() != panels[1].get_ylim()
    legend = [text.get_text() for text in saved["bias_overview"].legends[0].get_texts()]
    assert legend == [
        "head 0",
        "head 1",
        "head 2",
        "head 3",
        "training attention length",
        "bucket / clamp edge",
    ]


def test_cli_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plots, "load_trained", fake_loader)
    monkeypatch.setattr(plots, "sample_tokens", fake_sampler)
    bias_grid(tmp_path / "res")
    assert (
        main(["plot", str(tmp_path / "res"), "--kind", "terms", "--formats", "png", "--head", "1"])
        == 0
    )
    out = capsys.readouterr().out.split()
    assert len(out) == 4 and out[-1].endswith("figures/terms_overview.png")
    assert (
        main(
            ["plot", str(tmp_path / "res"), "--kind", "extrapolation", "--out", str(tmp_path / "f")]
        )
        == 0
    )
    assert (tmp_path / "f" / "extrapolation.pdf").exists()
    capsys.readouterr()
    for argv, message in [
        (
            ["--kind", "extrapolation", "--metric", "bleu"],
            "error: metric: 'bleu' is not a metric of these runs; available: ppl",
        ),
        (
            ["--kind", "bias", "--formats", "gif"],
            "error: --formats: gif not allowed; choose from png, pdf, svg",
        ),
        (
            ["--kind", "terms", "--layer", "5"],
            "error: layer: 5 is out of range; this model has layers 0..1",
        ),
    ]:
        assert main(["plot", str(tmp_path / "res"), *argv]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == message
    broken = tmp_path / "broken"
    make_run(
        broken,
        [*TINY, "model.attention.terms=a", "seed=7"],
        results=[({"segment_len": 8}, {"ppl": 1.0})],
    )
    make_run(broken, [*TINY, "seed=8"], state="failed")
    assert main(["plot", str(broken), "--kind", "attention"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    make_run(tmp_path / "none", [*TINY], state="running")
    assert main(["plot", str(tmp_path / "none"), "--kind", "bias"]) == 2
    assert "no finished runs with metrics (1 running)" in capsys.readouterr().err


def test_plot_names_a_module_the_runs_import_that_cannot_be_imported_here(tmp_path, capsys):
    runs = make_grid(tmp_path, PPL)
    for run in runs:
        config = yaml.safe_load((run / "config.yaml").read_text())
        (run / "config.yaml").write_text(
            yaml.safe_dump({**config, "imports": ["my_missing_schemes"]})
        )
    ids = ", ".join(sorted(run.name for run in runs))
    for target, which in ((tmp_path, f"runs {ids}"), (runs[0], f"run {runs[0].name}")):
        assert main(["plot", str(target), "--kind", "bias"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: imports: cannot import 'my_missing_schemes' (ModuleNotFoundError: No module "
            f"named 'my_missing_schemes'), listed under imports: by {which}; run plot from the "
            f"folder that holds my_missing_schemes (where the runs were trained), or add that "
            f"folder to PYTHONPATH"
        ]


def test_trained_runs_through_load_run_and_a_corrupt_checkpoint(tmp_path):
    from relpos_ablate.train.data import sample_inputs
    from relpos_ablate.train.run import load_run

    results = tmp_path / "res"
    shutil.copytree(trained_results(), results)
    df = collect(results)
    xl_dir = Path(df.loc[df["encoding"] == "xl", "run_dir"].iloc[0])
    config, model = load_run(xl_dir)
    fig = plots.run_figure("attention", config, model, "xl", -1, 0, plots.sample_tokens)
    tokens = sample_inputs(config, 32)  # memory (16) + one training segment (16)
    with torch.no_grad():
        _, mems = model(tokens[:, :16])
        expected = model.inspect(tokens[:, 16:], mems)["probs"]
    panels = [ax for ax in fig.axes if ax.get_images()]
    # layer 1, head 1
    image = np.ma.filled(panels[-1].get_images()[0].get_array().astype(float), np.nan)
    seen = ~np.isnan(image)
    assert image[seen] == pytest.approx(expected[1][0, 1].numpy()[seen], abs=1e-6)

    alibi_dir = Path(df.loc[df["encoding"] == "alibi", "run_dir"].iloc[0])
    ckpt = alibi_dir / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:100])  # a truncated checkpoint
    written, notes = plots.save_model_figures(df, "bias", tmp_path / "figs", formats=("png",))
    # one drawable run: no overview
    assert [p.name for p in written] == [f"bias_encoding-xl_seed-0_{xl_dir.name}.png"]
    assert len(notes) == 1 and notes[0].startswith(f"{alibi_dir}: skipped")
    assert main(["plot", str(alibi_dir), "--kind", "bias"]) == 2
