"""`relpos-ablate report`: a study's report function, found through the studies registry by the
experiment its runs belong to, reads the collected frame or the committed summary.csv alike;
`--correction` reaches it.

Run: .venv/bin/python -m pytest tests/analysis/test_reports.py -q
"""

import pandas as pd
import pytest

from fixtures.report_runs import make_grid
from relpos_ablate import studies
from relpos_ablate.analysis import collect
from relpos_ablate.cli import main
from relpos_ablate.config import ConfigError


@pytest.fixture
def grid(tmp_path, monkeypatch):
    monkeypatch.setattr(
        studies, "STUDIES", (*studies.STUDIES, studies.Study("fixtures.demo_study", ("demo",)))
    )
    make_grid(tmp_path, {("xl", 0): [6.0, 6.2], ("xl", 1): [6.2, 6.4], ("alibi", 0): [7.0, 7.0]})
    return tmp_path


def test_the_report_reads_the_results_dir_and_its_summary_csv_alike(grid, capsys):
    assert main(["report", str(grid / "demo")]) == 0
    from_runs = capsys.readouterr().out
    assert from_runs == "alibi: 7.000\nxl: 6.200\ncorrection: holm\n"  # (6.0 + 6.2 + 6.2 + 6.4) / 4
    assert main(["collect", str(grid / "demo"), "--out", str(grid / "summary.csv")]) == 0
    assert main(["report", str(grid / "summary.csv"), "--out", str(grid / "report.md")]) == 0
    assert (grid / "report.md").read_text() == from_runs
    assert main(["report", str(grid / "demo"), "--correction", "bh"]) == 0
    assert capsys.readouterr().out.endswith("correction: bh\n")


def test_an_experiment_without_a_report_is_one_line(grid, monkeypatch, capsys):
    monkeypatch.setattr(studies, "STUDIES", studies.STUDIES[:-1])
    assert main(["report", str(grid / "demo")]) == 2
    assert "no report for experiment 'demo'" in capsys.readouterr().err
    assert main(["report", str(grid / "missing.csv")]) == 2
    with pytest.raises(ConfigError, match=r"no report for the experiments demo \+ other together"):
        studies.make_report(pd.concat([collect(grid), collect(grid).assign(experiment="other")]))


def test_every_study_entry_names_what_its_module_holds():
    """The registry's text (what the command line lists without importing pandas) and the modules
    agree."""
    for study in studies.STUDIES:
        module = study.load()
        # every experiment has its own report; a report of several experiments together names
        # experiments of its study
        singles = {key for key in module.REPORTS if isinstance(key, str)}
        together = {name for key in module.REPORTS if isinstance(key, tuple) for name in key}
        assert singles <= set(study.experiments) and together <= set(study.experiments)
        assert set(study.experiments) <= singles | together
        assert set(study.layouts) == set(getattr(module, "LAYOUTS", {}))
        assert set(study.figures) == set(getattr(module, "FIGURES", {}))
    assert len(set(studies.LAYOUT_NAMES)) == len(studies.LAYOUT_NAMES)
    assert len(set(studies.FIGURE_KINDS)) == len(studies.FIGURE_KINDS)


def test_help_documents_the_correction(capsys):
    from relpos_ablate.analysis.stats import CORRECTIONS
    from relpos_ablate.cli.report import CORRECTION_CHOICES

    # the CLI's text copy (no scipy at start-up) stays in step
    assert CORRECTION_CHOICES == tuple(CORRECTIONS)
    for command in ("table", "report"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert (
            "--correction {holm,bh,none}" in text
            and "Benjamini" in text
            and "holm (default)" in text
        )


def test_table_and_figures_read_a_summary_csv_as_the_runs(grid, capsys, tmp_path):
    """A committed study keeps its summary.csv, not its run dirs: `table` and the figures drawn from
    the frame alone take it and give what the results dir gives; the figures that read run files say
    so in one line."""
    assert main(["collect", str(grid / "demo"), "--out", str(grid / "summary.csv")]) == 0
    capsys.readouterr()
    assert main(["table", str(grid / "demo"), "--baseline", "xl"]) == 0
    from_runs = capsys.readouterr().out
    assert main(["table", str(grid / "summary.csv"), "--baseline", "xl"]) == 0
    assert capsys.readouterr().out == from_runs
    assert main(["plot", str(grid / "summary.csv"), "--kind", "diagnostics"]) == 2
    assert "reads the run dirs" in capsys.readouterr().err
    assert (
        main(
            [
                "plot",
                str(grid / "summary.csv"),
                "--kind",
                "extrapolation",
                "--out",
                str(tmp_path),
                "--formats",
                "png",
            ]
        )
        == 0
    )
