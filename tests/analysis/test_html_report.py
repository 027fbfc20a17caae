"""`relpos-ablate plot --kind curves` and `relpos-ablate report DIR --html OUT.html` on a tiny real
grid (RoPE and ALiBi, 2 seeds each, 6 steps, trained by the grid runner): the curves' lines and
bands are read back from the figure and compared with each run's metrics.csv read here; the page's
table with the `table --baseline <first row>` output, its status rows with each run's status.json,
its embedded heatmaps and bias curves with model.inspect and ALiBi's slopes; the page names no
address and opens offline. Loaded in headless Chromium (Debian's `chromium`; skipped without it):
no console error, every section in the DOM after its script ran, a screenshot that is not blank.

Run: .venv/bin/python -m pytest tests/analysis/test_html_report.py -q
(about a minute: the grid trains)
"""

import base64
import csv
import io
import json
import re
import shutil
import statistics
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib import image as mpimg

from fixtures.runner import REPO, write_spec
from relpos_ablate.analysis import collect, html_report
from relpos_ablate.analysis.curves import BAND, curves_figure
from relpos_ablate.cli import main

ENCODINGS = ("rope", "alibi")
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def grid(tmp_path_factory) -> Path:
    """results/tiny of a grid the runner really trained (a module's worth of tests read it)."""
    root = tmp_path_factory.mktemp("html_grid")
    spec = write_spec(root, name="tiny", encodings=ENCODINGS, seeds=SEEDS, max_steps=6)
    argv = [sys.executable, "-m", "relpos_ablate", "grid", str(spec), "--results", str(root)]
    done = subprocess.run(
        [*argv, "--slots", "1"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "tiny"


@pytest.fixture(scope="module")
def page(grid, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("html_page") / "tiny.html"
    assert main(["report", str(grid), "--html", str(out)]) == 0
    return out


def metrics_rows(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(f)}


def runs_by_variant(grid: Path) -> dict[str, list[Path]]:
    """encoding -> its run dirs, from run.json (as the runner wrote it)."""
    runs: dict[str, list[Path]] = {}
    for run_json in sorted(grid.glob("*/run.json")):
        info = json.loads(run_json.read_text())
        runs.setdefault(info["variant"]["encoding"], []).append(run_json.parent)
    return runs


class Page(HTMLParser):
    """The page's elements: every tag's attributes, the ids, and the text of <pre> and script."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.pre: list[str] = []
        self._in_pre = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_pre = tag == "pre"

    def handle_endtag(self, tag):
        self._in_pre = self._in_pre and tag != "pre"

    def handle_data(self, data):
        if self._in_pre:
            self.pre.append(data)

    def ids(self) -> set[str]:
        return {attrs["id"] for _, attrs in self.tags if "id" in attrs}

    def images(self) -> list[dict]:
        return [attrs for tag, attrs in self.tags if tag == "img"]


def decode(uri: str) -> np.ndarray:
    prefix = "data:image/png;base64,"
    assert uri.startswith(prefix)
    return mpimg.imread(io.BytesIO(base64.b64decode(uri[len(prefix) :])), format="png")


def colours(pixels: np.ndarray) -> int:
    """Distinct colours of an RGBA image of floats in [0, 1] (each pixel packed into one uint32:
    np.unique over rows is ten times slower)."""
    rgba = np.round(pixels * 255).astype(np.uint8)
    if rgba.shape[-1] == 3:
        rgba = np.concatenate([rgba, np.full_like(rgba[..., :1], 255)], axis=-1)
    return len(np.unique(np.ascontiguousarray(rgba).reshape(-1, 4).view(np.uint32)))


# ---------------------------------------------------------------- training curves


def test_curves_are_seed_means_with_min_max_bands_of_metrics_csv(grid):
    fig, notes = curves_figure(collect(grid))
    assert notes == []
    (ax,) = fig.axes
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "train_loss"
    bands = iter(ax.collections)
    for encoding, run_dirs in runs_by_variant(grid).items():
        rows = [metrics_rows(run_dir) for run_dir in run_dirs]
        steps = sorted(rows[0])
        assert steps == [1, 3, 5]  # log_every 2 over 6 steps: global steps 1, 3, 5
        (line,) = [ln for ln in ax.get_lines() if ln.get_label() == f"encoding={encoding} (n=2)"]
        assert list(line.get_xdata()) == steps
        means = [statistics.mean(r[s] for r in rows) for s in steps]
        assert list(line.get_ydata()) == pytest.approx(means, rel=1e-12)
    # the bands in variant order (fill_between: one polygon from the lows and the highs)
    for encoding in ("rope", "alibi"):
        rows = [metrics_rows(run_dir) for run_dir in runs_by_variant(grid)[encoding]]
        vertices = next(bands).get_paths()[0].vertices
        for step in (1, 3, 5):
            at = vertices[vertices[:, 0] == step][:, 1]
            values = [r[step] for r in rows]
            assert min(at) == pytest.approx(min(values)) and max(at) == pytest.approx(max(values))
    assert BAND in [text.get_text() for text in ax.get_legend().get_texts()]


def test_curves_stop_at_the_last_step_every_seed_logged(grid, tmp_path):
    results = tmp_path / "tiny"
    shutil.copytree(grid, results)
    alibi = runs_by_variant(results)["alibi"]
    short = alibi[1] / "metrics.csv"
    short.write_text("".join(short.read_text().splitlines(keepends=True)[:3]))  # steps 1, 3
    (runs_by_variant(results)["rope"][0] / "metrics.csv").unlink()
    fig, notes = curves_figure(collect(results))
    (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "encoding=alibi (n=2)"]
    assert list(line.get_xdata()) == [1, 3]
    assert any("encoding=alibi" in n and "stop at step 3" in n for n in notes)
    assert any("no metrics.csv: encoding=rope seed" in n for n in notes)
    (rope,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "encoding=rope (n=1)"]
    only = metrics_rows(runs_by_variant(results)["rope"][1])
    assert list(rope.get_ydata()) == pytest.approx([only[s] for s in (1, 3, 5)])


def test_cli_plot_kind_curves_and_its_one_line_errors(grid, tmp_path, capsys):
    argv = ["plot", str(grid), "--kind", "curves", "--out", str(tmp_path), "--formats", "png"]
    assert main(argv) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "curves.png")]
    assert mpimg.imread(tmp_path / "curves.png").shape[0] > 100
    assert main(["plot", str(grid), "--kind", "curves", "--metric", "val_loss"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: metric: 'val_loss' is in no run's metrics.csv; logged: epoch, lr, train_acc, "
        "train_loss"
    )


# ---------------------------------------------------------------- the page


def test_page_has_every_section_embedded_images_and_no_address(page):
    text = page.read_text()
    parsed = Page(text)
    assert set(html_report.SECTIONS) <= parsed.ids()
    # nothing fetched: no address in any src or href, no stylesheet or script file
    for _, attrs in parsed.tags:
        for name in ("src", "href"):
            value = attrs.get(name) or ""
            assert not re.match(r"(https?:)?//", value), (name, value[:80])
    assert not re.search(r"https?://", text)
    assert [tag for tag, attrs in parsed.tags if tag in ("link", "iframe")] == []
    assert all("src" not in attrs for tag, attrs in parsed.tags if tag == "script")
    # RoPE adds no bias: the bias explorer says so for each of its runs instead of a figure
    for seed in SEEDS:
        assert f"encoding=rope, seed {seed} has no bias curve: bias='none'" in text
    images = parsed.images()
    # extrapolation, curves; attention: 4 runs x 2 layers x 2 heads; bias: 2 ALiBi runs x 2 x 2
    assert len(images) == 2 + 16 + 8
    for attrs in images:
        pixels = decode(attrs["src"])
        assert pixels.shape[0] > 50 and pixels.shape[1] > 50
        assert colours(pixels) > 2


def test_page_table_is_the_table_command_against_the_first_row(page, grid, capsys):
    assert main(["table", str(grid), "--baseline", "rope"]) == 0
    expected = capsys.readouterr().out
    assert "Tests:" in expected
    assert "".join(Page(page.read_text()).pre) == expected


def test_page_status_rows_are_each_runs_status_json(page, grid):
    text = page.read_text()
    total_wall, total_steps = 0.0, 0
    for encoding, run_dirs in runs_by_variant(grid).items():
        for run_dir in run_dirs:
            status = json.loads((run_dir / "status.json").read_text())
            assert status["state"] == "done"
            row = (
                f'<td class="label">encoding={encoding}</td><td class="label">'
                f'{_seed(run_dir)}</td><td class="label">{run_dir.name}</td>'
                f'<td class="label">done</td><td>{status["step"]} / {status["max_steps"]}</td>'
                f"<td>{status['wall_time_s']:.1f}</td>"
            )
            assert row in text
            total_wall += status["wall_time_s"]
            total_steps += status["step"]
    assert f"4 runs (4 done); {total_steps} training steps, {total_wall:.1f} s" in text


def _seed(run_dir: Path) -> int:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["seed"]


def test_explorers_hold_each_runs_heatmaps_and_bias_curves(grid, monkeypatch):
    """The figures behind the embedded images: each heatmap is the run's model.inspect
    probabilities on the sample the page draws, each bias panel ALiBi's -m_h * distance with
    m_h = 2^(-8 (h + 1) / H), the chosen head bold; RoPE runs say why they have no bias curve."""
    from relpos_ablate.analysis import plots
    from relpos_ablate.train.run import load_run

    drawn, widths = [], []

    def record(fig):
        """The figure, and its head curves' widths as they are saved (one figure per layer is
        saved once per head)."""
        drawn.append(fig)
        lines = [ln for ax in fig.axes for ln in ax.get_lines()]
        widths.append(
            {"title": fig.get_suptitle(), **{ln.get_label(): ln.get_linewidth() for ln in lines}}
        )
        return "data:,"

    monkeypatch.setattr(html_report, "png_uri", record)
    _, notes = html_report.html_report(collect(grid), str(grid))
    assert notes == []
    heatmaps = [f for f in drawn if f.axes[0].get_images()]
    assert len(heatmaps) == 16
    runs = runs_by_variant(grid)
    alibi = runs["alibi"][0]
    config, model = load_run(alibi)
    details, n_mem = plots.inspect_run(config, model, plots.sample_tokens)
    title = f"encoding=alibi, seed {_seed(alibi)}\nlayer 1, head 1"
    (fig,) = [f for f in heatmaps if f.axes[0].get_title() == title]
    values = np.ma.filled(fig.axes[0].get_images()[0].get_array().astype(float), np.nan)
    seen = ~np.isnan(values)
    expected = details["probs"][1][0, 1].numpy()
    assert values[seen] == pytest.approx(expected[seen], abs=1e-6)
    assert seen.sum() == 16 * 17 // 2  # causal: the lower triangle of 16 queries x 16 keys

    # one figure per (run, layer) saved once per head, that head bold: ALiBi runs only
    bias = [
        (fig, saved) for fig, saved in zip(drawn, widths) if fig.get_suptitle().endswith("in bold")
    ]
    assert [fig.get_suptitle().split(", seed")[0] for fig, _ in bias] == ["encoding=alibi"] * 8
    heads = 2
    for k, (fig, saved) in enumerate(bias):
        chosen = k % heads
        assert saved["title"].endswith(f"head {chosen} in bold")
        assert saved[f"head {chosen}"] > saved[f"head {1 - chosen}"]
        (ax,) = fig.axes
        for h in range(heads):
            (line,) = [ln for ln in ax.get_lines() if ln.get_label() == f"head {h}"]
            d = np.asarray(line.get_xdata(), dtype=float)
            slope = 2 ** (-8 * (h + 1) / heads)
            assert np.asarray(line.get_ydata()) == pytest.approx(-slope * d, abs=1e-6)


def test_report_html_reads_one_results_dir(grid, tmp_path, capsys):
    summary = tmp_path / "summary.csv"
    assert main(["collect", str(grid), "--out", str(summary)]) == 0
    capsys.readouterr()
    assert main(["report", str(summary), "--html", str(tmp_path / "p.html")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --html: give one results dir (the page reads its run dirs: training curves, "
        "trained weights), not a summary.csv or several sources"
    )
    assert not (tmp_path / "p.html").exists()


# ---------------------------------------------------------------- headless Chromium

CHOOSE = """
var boxes = document.querySelectorAll('.explorer');
function choose(box, values) {
  var selects = box.querySelectorAll('select');
  values.forEach(function (v, k) { selects[k].value = v; });
  selects[0].dispatchEvent(new Event('change'));
}
choose(boxes[0], ['0', '0', '0', '0']);
choose(boxes[1], ['1', '1', '1', '1']);
"""
"""A user's choice in each explorer's menus, appended to a copy of the page."""


def test_page_in_headless_chromium(page, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium here (Debian: apt-get install chromium; .ci/run installs it)")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1280,2000",
    ]
    shot = tmp_path / "shot.png"
    url = page.resolve().as_uri()
    taken = subprocess.run(
        [chromium, *flags, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120
    )
    dom = subprocess.run(
        [chromium, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120
    )
    for run in (taken, dom):
        assert run.returncode == 0, run.stderr[-2000:]
        # a page's console messages and uncaught exceptions: `INFO:CONSOLE(line)] "..."`
        console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
        assert console == [] and "Uncaught" not in run.stderr
    parsed = Page(dom.stdout)
    assert set(html_report.SECTIONS) <= parsed.ids()
    # the script ran: each explorer shows the one figure its menus choose, preset to its first
    # image (bias: ALiBi seed 0, as RoPE has none; attention: RoPE seed 0), layer 0, head 0
    shown = [a for t, a in parsed.tags if t == "figure" and "data-key" in a and "hidden" not in a]
    assert [a["data-key"] for a in shown] == ["1|0|0|0", "0|0|0|0"]
    explorers = [a for t, a in parsed.tags if t == "div" and a.get("class") == "explorer"]
    assert [a.get("data-shown") for a in explorers] == ["1|0|0|0", "0|0|0|0"]
    # choosing: another run, layer and head in the attention menus; RoPE in the bias menus
    chosen = tmp_path / "chosen.html"
    chosen.write_text(page.read_text().replace("</body>", f"<script>{CHOOSE}</script></body>"))
    after = subprocess.run(
        [chromium, *flags, "--dump-dom", chosen.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ":CONSOLE" not in after.stderr
    parsed = Page(after.stdout)
    explorers = [a for t, a in parsed.tags if t == "div" and a.get("class") == "explorer"]
    assert [a.get("data-shown") for a in explorers] == ["", "1|1|1|1"]
    shown = [a for t, a in parsed.tags if t == "figure" and "data-key" in a and "hidden" not in a]
    assert [a["data-key"] for a in shown] == ["1|1|1|1"]
    # the one figure not hidden (the bias explorer's 1|1|1|1 is)
    alt = re.search(r'data-key="1\|1\|1\|1"><img alt="([^"]*)"', after.stdout)
    assert alt and alt.group(1) == "attention: encoding=alibi, seed 1, layer 1, head 1"
    empty = re.search(r'<p class="empty note">([^<]*)</p>', after.stdout)
    assert empty and empty.group(1).startswith("encoding=rope, seed 0 has no bias curve")
    pixels = mpimg.imread(shot)
    assert pixels.shape[:2] == (2000, 1280)
    assert colours(pixels) > 16  # text, tables and figures, not one blank colour
