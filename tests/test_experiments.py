"""The shipped experiments/ (listed by name, so a user's own spec there is not held to these tests):
every grid spec parses and expands (dry, no training), says what it reproduces and what it costs,
carries a usable `table:` block; the paper specs hold the paper's settings; the demo grid stays
small enough for `make demo`; only the reports (demo, reproductions, length_generalization) are
committed.

Run: .venv/bin/python -m pytest tests/test_experiments.py -q   (about a second, no training)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from relpos_ablate.analysis.collect import SETTING_FIELDS
from relpos_ablate.analysis.table_options import spec_options
from relpos_ablate.config import RunConfig, load_run_config
from relpos_ablate.config.yaml_io import load_yaml
from relpos_ablate.runner.axes import check_key_path
from relpos_ablate.runner.grid import is_grid_spec, load_grid

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
SHIPPED_SPECS = (
    "alibi_extrapolation_cpu",
    "alibi_table2",
    "bias_types",
    "demo",
    "fair_baselines",
    "hybrid_schedules",
    "hybrid_schedules_retrieval",
    "length_generalization",
    "ruler_tiny",
    "smoke",
    "xl_table6",
    "xl_table6_cpu",
    "xl_terms",
)
"""The grid specs this project ships, by name: a spec of the user's own in experiments/ is not held
to these tests (add a new shipped spec here)."""
SHIPPED_RUN_CONFIGS = ("tiny_run",)
REQUIRED = {
    "demo",
    "xl_terms",
    "bias_types",
    "xl_table6",
    "xl_table6_cpu",
    "alibi_table2",
    "length_generalization",
    "alibi_extrapolation_cpu",
    "fair_baselines",
    "ruler_tiny",
    "hybrid_schedules",
    "hybrid_schedules_retrieval",
}
DEMO_BUDGET_STEPS = 14_000
"""Upper bound on training steps summed over the demo's runs (27 x 500 today: the grid ~4 min on 2
cores)."""


def _raw(path: Path) -> dict:
    return load_yaml(path.read_text())


SPECS = [EXPERIMENTS / f"{name}.yaml" for name in SHIPPED_SPECS]
RUN_CONFIGS = [EXPERIMENTS / f"{name}.yaml" for name in SHIPPED_RUN_CONFIGS]


def _header(path: Path) -> str:
    """The leading comment block of a file, without the '#' marks."""
    lines = itertools.takewhile(lambda line: line.startswith("#"), path.read_text().splitlines())
    return "\n".join(line.lstrip("#").strip() for line in lines)


def _attention(config: RunConfig):
    return config.model.attention


def test_every_required_spec_is_shipped():
    assert REQUIRED <= set(SHIPPED_SPECS)
    assert all(path.is_file() for path in SPECS + RUN_CONFIGS)
    assert all(is_grid_spec(_raw(path)) for path in SPECS) and not any(
        is_grid_spec(_raw(p)) for p in RUN_CONFIGS
    )


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_spec_expands_and_names_its_results_dir_after_the_file(path):
    spec = load_grid(path)
    assert spec.name == path.stem
    assert len(spec.runs) == len({run.run_id for run in spec.runs}) > 0


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_header_says_what_it_reproduces_its_cost_and_the_command(path):
    header = _header(path)
    assert len(header.splitlines()) >= 3, "a header comment saying what the spec reproduces"
    assert "Cost:" in header
    assert f"relpos-ablate grid experiments/{path.name}" in header


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_table_block_names_real_rows_cols_and_the_task_metric(path):
    raw, spec = _raw(path), load_grid(path)
    assert "table" in raw or path.stem not in REQUIRED, (
        "the issue's specs each carry a table: block"
    )
    options = spec_options(raw)
    axes = set(spec.axes)
    for key in options.rows or ():
        if key not in axes:
            check_key_path(key)  # raises ConfigError for a name that is neither an axis nor a field
    assert set(options.cols or ()) <= set(SETTING_FIELDS)
    synthetic = {run.config.data.source == "synthetic" for run in spec.runs}
    examples = {run.config.data.example_task for run in spec.runs}
    assert options.metric in (
        None,
        "exact_match" if examples == {True} else "acc" if synthetic == {True} else "ppl",
    )
    if options.layout in ("xl_table6", "length_generalization"):
        assert options.rows is None and options.cols is None, (
            f"the {options.layout} layout fixes its own columns"
        )


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.stem)
def test_single_run_configs_load(path):
    assert isinstance(load_run_config(path), RunConfig)


def test_demo_is_small_and_covers_the_main_encodings_at_1x_2x_4x():
    spec = load_grid(EXPERIMENTS / "demo.yaml")
    configs = [run.config for run in spec.runs]
    assert sum(c.train.max_steps for c in configs) <= DEMO_BUDGET_STEPS
    assert all(
        c.data.source == "synthetic" and c.model.d_model <= 64 and c.model.n_layers <= 2
        for c in configs
    )
    for c in configs:
        lengths = sorted(s.segment_len for s in c.eval_settings())
        assert lengths == [c.train.segment_len * k for k in (1, 2, 4)]
    seeds = {c.seed for c in configs}
    assert len(seeds) >= 3, "three seeds: a table's tests need at least 3 a side"
    schemes = {(a.terms, a.bias, a.absolute) for a in map(_attention, configs)}
    required = {
        ("abcd", "none", "none"),
        ("a", "t5", "none"),
        ("a", "alibi", "none"),
        ("a", "xl_table", "none"),
        ("a", "none", "none"),
        ("a", "none", "learned"),
    }
    assert required <= schemes
    assert len({terms for terms, bias, absolute in schemes if bias == absolute == "none"}) >= 4, (
        "term subsets"
    )
    assert len(configs) == len(schemes) * len(seeds)


def test_xl_terms_covers_all_15_subsets_with_and_without_memory():
    configs = [run.config for run in load_grid(EXPERIMENTS / "xl_terms.yaml").runs]
    subsets = {"".join(c) for n in range(1, 5) for c in itertools.combinations("abcd", n)}
    assert len(subsets) == 15
    cells = {(c.model.attention.terms, c.model.mem_len > 0) for c in configs}
    assert cells == {(terms, memory) for terms in subsets for memory in (False, True)}


def test_bias_types_covers_every_bias_type_and_the_baselines_on_one_footing():
    """The spec is the experiment's literal record (its runs and cost are written in it), so it
    lists its encodings; the registry says which bias types it must cover: every built-in one (a
    scheme of your own joins a copy of the spec, with `imports:` in its base)."""
    from relpos_ablate.config.registry import BUILTIN_BIASES

    configs = [run.config for run in load_grid(EXPERIMENTS / "bias_types.yaml").runs]
    attention = [_attention(c) for c in configs]
    missing = [name for name in BUILTIN_BIASES if name not in {a.bias for a in attention}]
    assert not missing, (
        f"add {missing} to the encoding axis of experiments/bias_types.yaml (and its run count)"
    )
    assert {a.bias for a in attention} <= {"none", *BUILTIN_BIASES}
    assert {"none", "sinusoid", "learned", "rope"} <= {a.absolute for a in attention}
    shared = {
        (c.model.d_model, c.model.n_layers, c.train.max_steps, c.train.lr, c.data.task, c.eval)
        for c in configs
    }
    assert len(shared) == 1, "every encoding gets the same model, budget, task and evaluation"


# Transformer-XL Table 6 (Dai et al. 2019), as printed: (recurrence, encoding, loss) of its 9 rows.
TABLE6_ROWS = {
    (True, "ours", "full"),
    (True, "shaw", "full"),
    (True, "ours", "half"),
    (False, "ours", "full"),
    (False, "ours", "half"),
    (False, "shaw", "full"),
    (False, "shaw", "half"),
    (False, "vaswani", "half"),
    (False, "al_rfou", "half"),
}


def _table6_encoding(config: RunConfig) -> str:
    a = config.model.attention
    if a.terms == "abcd" and a.rel == "sinusoid" and a.absolute == "none":
        return "ours"
    if a.terms == "ab" and a.rel == "learned" and a.absolute == "none":
        return "shaw"
    return {"sinusoid": "vaswani", "learned_per_layer": "al_rfou"}[a.absolute]


@pytest.mark.parametrize("name", ["xl_table6", "xl_table6_cpu"])
def test_xl_table6_specs_have_exactly_the_papers_nine_rows(name):
    spec = load_grid(EXPERIMENTS / f"{name}.yaml")
    configs = [run.config for run in spec.runs]
    rows = [(c.model.mem_len > 0, _table6_encoding(c), c.train.loss_on) for c in configs]
    assert set(rows) == TABLE6_ROWS and len(rows) == len(set(zip(rows, (c.seed for c in configs))))
    # the committed study: every row 3 seeds or more, the XL rows at least 5
    if name == "xl_table6_cpu":
        seeds = {row: sum(r == row for r in rows) for row in TABLE6_ROWS}
        assert (
            min(seeds.values()) >= 3 and min(n for row, n in seeds.items() if row[1] == "ours") >= 5
        )
    attn_lens = {s.segment_len + (s.mem_len or 0) for c in configs for s in c.eval_settings()}
    assert len(attn_lens) >= 4, "PPL best needs several evaluation attention lengths"


def test_xl_table6_uses_the_papers_wt103_base_configuration():
    for run in load_grid(EXPERIMENTS / "xl_table6.yaml").runs:
        m, t = run.config.model, run.config.train
        assert (m.n_layers, m.d_model, m.n_heads, m.d_head, m.d_inner, m.dropout) == (
            16,
            410,
            10,
            41,
            2100,
            0.1,
        )
        assert (t.optimizer, t.lr, t.schedule, t.grad_clip, t.max_steps, t.batch_size) == (
            "adam",
            2.5e-4,
            "cosine",
            0.25,
            200_000,
            60,
        )
        assert t.segment_len == 128 and m.mem_len in (0, 128)
        assert run.config.data.corpus == "wikitext-103"


def test_xl_table6_cpu_reads_the_shipped_corpus_fits_a_cpu_and_asks_for_the_recl_ladder():
    for run in load_grid(EXPERIMENTS / "xl_table6_cpu.yaml").runs:
        config = run.config
        assert config.data.corpus == "tinyshakespeare" and config.data.tokenizer == "char"
        assert config.model.d_model <= 128 and config.train.max_steps <= 5000
        ladder = [s for s in config.eval_settings() if s.token_losses]
        own = {("xl" if config.model.mem_len else "sliding")}  # measured the way it was trained
        assert {s.protocol for s in ladder} == own and all(
            s.max_targets == config.eval.recl_targets for s in ladder
        )
        attn = [s.attn_len(config.model.mem_len) for s in ladder]
        # PPL init: the training attention length
        assert config.train.segment_len + config.model.mem_len in attn
        # room for PPL best beyond it
        assert max(attn) >= 4 * (config.train.segment_len + config.model.mem_len)
        # RECL: one step Δ
        assert len(attn) >= 4 and len({b - a for a, b in zip(attn, attn[1:])}) == 1
    seeds = {run.config.seed for run in load_grid(EXPERIMENTS / "xl_table6_cpu.yaml").runs}
    assert len(seeds) >= 3


def test_alibi_extrapolation_cpu_evaluates_1x_to_16x_with_both_protocols():
    runs = load_grid(EXPERIMENTS / "alibi_extrapolation_cpu.yaml").runs
    assert {run.variant["encoding"] for run in runs} == {
        "vaswani",
        "learned",
        "rope",
        "rope_xpos",
        "t5",
        "alibi",
        "kerple_log",
        "fire",
        "sandwich",
        "fox",
        "cope",
        "xl",
        "nope",
        "p_rope",
        "ssmax",
        "stick_breaking",
        "path",
        "dape",
        "dape_v2",
    }
    for c in (run.config for run in runs):
        assert (
            c.data.corpus == "tinyshakespeare"
            and c.model.mem_len == 0
            and c.train.segment_len == 64
        )
        plain = {(s.protocol, s.segment_len) for s in c.eval_settings() if s.rope_scaling is None}
        assert plain == {
            (p, 64 * k) for p in ("non_overlapping", "sliding") for k in (1, 2, 4, 8, 16)
        }
        extended = {
            (s.protocol, s.segment_len, s.rope_scaling) for s in c.eval_settings() if s.rope_scaling
        }
        assert extended == {
            ("non_overlapping", 64 * k, kind) for k in (4, 8) for kind in ("pi", "ntk", "yarn")
        }
    assert len({run.config.seed for run in runs}) >= 3, (
        "an ordering needs Welch's test over >= 3 seeds a side"
    )


def causal_t5_bucket(distance: int, num_buckets: int, max_distance: int) -> int:
    """T5's unidirectional bucket of a distance i - j >= 0 (Mesh TensorFlow / HuggingFace
    `_relative_position_bucket`, bidirectional=False), written here from that definition."""
    exact = num_buckets // 2
    if distance < exact:
        return distance
    return min(
        num_buckets - 1,
        exact
        + int(math.log(distance / exact) / math.log(max_distance / exact) * (num_buckets - exact)),
    )


def far_bucket_start(num_buckets: int, max_distance: int) -> int:
    return next(
        d
        for d in range(10 * max_distance)
        if causal_t5_bucket(d, num_buckets, max_distance) == num_buckets - 1
    )


def test_alibi_extrapolation_cpus_t5_trains_its_far_bucket_as_the_paper_did():
    """The ALiBi paper's T5 bias is HuggingFace's (32 buckets, max_distance 128) trained at L = 512:
    every distance from 113 on shares the far bucket, and training reaches it. Here max_distance / L
    is the paper's 1/4 and the far bucket starts at about the same share of L, well inside the
    training length; the other rows keep the defaults (their run ids unchanged)."""
    runs = load_grid(EXPERIMENTS / "alibi_extrapolation_cpu.yaml").runs
    (t5,) = {
        (
            r.config.model.attention.num_buckets,
            r.config.model.attention.max_distance,
            r.config.train.segment_len,
        )
        for r in runs
        if r.variant["encoding"] == "t5"
    }
    buckets, distance, train = t5
    paper = far_bucket_start(32, 128)
    assert paper == 113 and paper < 512
    assert distance / train == 128 / 512
    assert far_bucket_start(buckets, distance) < train
    assert far_bucket_start(buckets, distance) / train == pytest.approx(paper / 512, abs=0.02)
    assert far_bucket_start(32, 128) >= 64, "the defaults at L = 64 never train the far bucket"
    others = {
        (r.config.model.attention.num_buckets, r.config.model.attention.max_distance)
        for r in runs
        if r.variant["encoding"] != "t5"
    }
    assert others == {(32, 128)}


def test_alibi_table2_trains_at_l_and_evaluates_up_to_about_30x():
    configs = [run.config for run in load_grid(EXPERIMENTS / "alibi_table2.yaml").runs]
    schemes = {(a.absolute, a.bias) for a in map(_attention, configs)}
    assert schemes == {("sinusoid", "none"), ("rope", "none"), ("none", "t5"), ("none", "alibi")}
    for c in configs:
        longest = max(s.segment_len for s in c.eval_settings())
        assert c.train.segment_len == 512 and longest >= 30 * c.train.segment_len
        assert c.model.attention.max_position >= longest


def test_length_generalization_is_the_issues_suite_on_equal_footing():
    """9 encodings (+ randomized RoPE and ALiBi) x example tasks x 3 seeds; trained on short
    examples until they are learnt (or the cap), tested up to 3x longer with the in-distribution bin
    kept, enough examples per bin for a standard error of a seed's exact match <= 0.02; every
    variant with the same model, budget and evaluation."""
    configs = [run.config for run in load_grid(EXPERIMENTS / "length_generalization.yaml").runs]
    assert len({c.seed for c in configs}) == 3
    assert all(c.data.example_task for c in configs) and len({c.data.task for c in configs}) >= 4
    assert "passkey" in {c.data.task for c in configs}, "the depth x length figure needs passkey"
    schemes = {(a.terms, a.absolute, a.bias, a.positions) for a in map(_attention, configs)}
    nine = {
        ("a", "none", "none"),
        ("a", "sinusoid", "none"),
        ("a", "learned", "none"),
        ("a", "rope", "none"),
        ("a", "none", "t5"),
        ("a", "none", "alibi"),
        ("a", "none", "kerple_log"),
        ("a", "none", "fire"),
        ("abcd", "none", "none"),
    }
    assert schemes == {(*s, "sequential") for s in nine} | {
        ("a", "rope", "none", "randomized"),
        ("a", "none", "alibi", "randomized"),
    }
    assert {"copy", "reverse"} <= {c.data.task for c in configs}, (
        "Kazemnejad et al.'s primitive tasks"
    )
    for c in configs:
        trained = c.data.train_lengths[1]
        assert (
            c.data.test_lengths[0][1]
            <= trained
            < c.data.test_lengths[-1][0]
            <= c.data.test_lengths[-1][1]
            >= 3 * trained
        )
        assert c.eval.diagnostics and c.model.attention.max_position > c.data.input_length(
            c.data.test_lengths[-1][1]
        )
        assert (0.25 / c.data.eval_examples) ** 0.5 <= 0.02, (
            "a seed's exact match in a bin: standard error <= 0.02"
        )
        assert c.train.stop_at_exact_match == 0.99 and c.train.max_steps > c.train.stop_check_every
    shared = {
        (
            c.model.d_model,
            c.model.n_layers,
            c.train.max_steps,
            c.train.lr,
            c.data.test_lengths,
            c.eval,
        )
        for c in configs
    }
    assert len(shared) == 1, "every encoding and task gets the same model, budget and evaluation"


def test_fair_baselines_tunes_the_lr_of_every_preset_trained_as_a_new_user_would():
    """Every encoding preset, 3 layers of d_model 128 on segments of 64 characters of the shipped
    corpus and every other field at its default, but the learning rate: a sweep that holds the
    default; 3 seeds; each run scored at L on valid and on test, the table picking the rate on
    valid."""
    from relpos_ablate.config import ModelConfig, TrainConfig
    from relpos_ablate.config.presets import presets

    raw = _raw(EXPERIMENTS / "fair_baselines.yaml")
    runs = load_grid(EXPERIMENTS / "fair_baselines.yaml").runs
    configs = [run.config for run in runs]
    # every preset but those added after the study (issue 59: not swept, said in its README)
    swept = set(presets()) - {"pope", "grape_a", "grape_ap", "mla_rope"}
    assert {run.variant["encoding"] for run in runs} == swept
    rates = {
        p: sorted({r.config.train.lr for r in runs if r.variant["encoding"] == p}) for p in swept
    }
    every = set.intersection(*(set(r) for r in rates.values()))
    # a sweep every preset runs, the default in it
    assert len(every) >= 3 and TrainConfig().lr in every
    # rates beyond it only below the default, for the presets whose pick sat at 1e-3 (the lower
    # edge)
    assert {p: sorted(set(r) - every) for p, r in rates.items() if set(r) - every} == {
        "kerple_power": [5e-4],
        "fox": [5e-4],
    }
    assert (
        len({c.seed for c in configs}) >= 3
        and len(configs) == sum(len(r) for r in rates.values()) * 3
    )
    for c in configs:
        assert (c.data.corpus, c.data.tokenizer, c.model.n_layers, c.model.d_model) == (
            "tinyshakespeare",
            "char",
            3,
            128,
        )
        assert (
            dataclasses.replace(
                c.model, n_layers=ModelConfig().n_layers, attention=ModelConfig().attention
            )
            == ModelConfig()
        )
        assert (
            dataclasses.replace(
                c.train,
                lr=TrainConfig().lr,
                max_steps=TrainConfig().max_steps,
                log_every=TrainConfig().log_every,
                checkpoint_every=TrainConfig().checkpoint_every,
            )
            == TrainConfig()
        )
        assert [(s.segment_len, s.protocol, s.split) for s in c.eval_settings()] == [
            (64, "non_overlapping", "valid"),
            (64, "non_overlapping", "test"),
        ]
    options = spec_options(raw)
    assert (options.best_over, options.select_split, options.report_split) == (
        "train.lr",
        "valid",
        "test",
    )


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
@pytest.mark.parametrize(
    "path, ignored",
    [
        ("results/demo/0123456789/checkpoints/last.ckpt", True),
        ("results/demo/0123456789/worker.log", True),
        ("results/demo/figures/bias_0123456789.png", True),
        ("results/other/0123456789/eval.json", True),
        ("results/demo/summary.csv", False),
        ("results/demo/table.md", False),
        ("results/demo/table.tex", False),
        ("results/demo/figures/extrapolation.png", False),
        ("results/demo/figures/bias_overview.png", False),
        ("results/README.md", False),
        ("results/xl_table6_cpu/0123456789/token_losses.npz", True),
        ("results/xl_table6_cpu/.grid.out", True),
        ("results/xl_table6_cpu/table6.md", False),
        ("results/xl_table6_cpu/table8.md", False),
        ("results/xl_table6_cpu/grid.txt", False),
        ("results/xl_table6_cpu/figures/extrapolation.png", False),
        ("results/alibi_extrapolation_cpu/0123456789/checkpoints/last.ckpt", True),
        ("results/alibi_extrapolation_cpu/table.md", False),
        ("results/alibi_extrapolation_cpu/table_appb.md", False),
        ("results/alibi_extrapolation_cpu/report.md", False),
        ("results/alibi_extrapolation_cpu/appb.txt", False),
        ("results/alibi_extrapolation_cpu/.appb.out", True),
        ("results/alibi_extrapolation_cpu/summary.csv", False),
        ("results/alibi_extrapolation_cpu/figures/position_loss.png", False),
        ("results/length_generalization/0123456789/eval.json", True),
        ("results/length_generalization/0123456789/checkpoints/last.ckpt", True),
        ("results/length_generalization/README.md", False),
        ("results/length_generalization/table.md", False),
        ("results/length_generalization/report.md", False),
        ("results/length_generalization/figures/lengthgen.png", False),
        ("results/length_generalization/summary.csv", False),
        ("results/length_generalization/grid.txt", False),
        ("results/length_generalization/figures/diagnostics_copy.png", False),
        ("results/length_generalization/figures/passkey.pdf", False),
        ("results/fair_baselines/0123456789/checkpoints/last.ckpt", True),
        ("results/fair_baselines/summary.csv", False),
        ("results/fair_baselines/table.md", False),
        ("results/fair_baselines/report.md", False),
        ("results/fair_baselines/grid.txt", False),
        ("results/fair_baselines/figures/lr_sweep.png", False),
    ],
)
def test_only_the_reports_are_committed(path, ignored):
    result = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
    assert result.returncode == (0 if ignored else 1)
