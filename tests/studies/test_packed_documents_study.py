"""The packed-documents study (relpos_ablate/studies/packed_documents.py) on hand-made run dirs
whose every number is known (2 encodings x 2 documents modes x 2 seeds x 2 evaluation settings):
the loss by place in the document read from eval.json and from documents.csv alike, the report's
exploratory tables against pandas recomputed here from the records written, the figure's files;
and, once committed, the same tables on results/packed_documents/summary.csv and documents.csv.
Run: .venv/bin/python -m pytest tests/studies/test_packed_documents_study.py -q"""

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fixtures.report_runs import ENCODINGS, make_run
from relpos_ablate.analysis.collect import collect, read_summary
from relpos_ablate.config import ConfigError
from relpos_ablate.io import atomic_write_yaml
from relpos_ablate.studies import make_report
from relpos_ablate.studies.packed_documents import document_curves, figure

MODES = ("concatenate", "packed_reset")
SEEDS = (0, 1)
SETTINGS = ({"segment_len": 64}, {"segment_len": 512, "protocol": "sliding", "stride": 64})
EDGES = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
TEXT = [
    "data.source=text",
    "data.corpus=tinyshakespeare",
    "data.tokenizer=bpe",
    "data.vocab_size=2048",
    "train.segment_len=64",
]
SPEC = {
    "name": "packed_documents",
    "zip": [{"encoding": list(ENCODINGS)}],
    "grid": {"data.documents": list(MODES)},
    "seeds": list(SEEDS),
    "table": {"rows": ["encoding", "data.documents"], "cols": ["protocol", "segment_len"]},
    "analysis": {
        "scale": "loss",
        "seeds": list(SEEDS),
        "families": [
            {
                "name": "at 8L (sliding, 512): packed_reset against concatenate, per encoding",
                "role": "primary",
                "where": ["segment_len=512", "protocol=sliding"],
                "each": "data.documents",
                "vs": "concatenate",
                "values": ["packed_reset"],
                "by": ["encoding"],
            }
        ],
    },
}
RESULTS = Path(__file__).resolve().parents[2] / "results" / "packed_documents"


def documents_record(rng, empty_bin: bool) -> dict:
    """eval.json's "documents" of a setting (train/document_metrics.py), random but consistent."""
    tokens = rng.integers(5, 60, len(EDGES) - 1)
    if empty_bin:
        tokens[-1] = 0
    loss = rng.uniform(1.0, 6.0, len(EDGES) - 1)
    high = np.array(EDGES[:-1]) >= 64
    beyond = float((loss * tokens)[high].sum() / tokens[high].sum())
    return {
        "tokens": int(tokens.sum()),
        "tokens_without_start": 3,
        "documents": 20,
        "loss": float(rng.uniform(2.0, 4.0)),
        "token_loss": float((loss * tokens).sum() / tokens.sum()),
        "position_loss": {
            "edges": EDGES,
            "loss": [float(v) if n else None for v, n in zip(loss, tokens)],
            "tokens": [int(n) for n in tokens],
        },
        "beyond_train_length": {"from": 64, "loss": beyond, "tokens": int(tokens[high].sum())},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(collected frame, the records written: (encoding, mode, seed, segment_len) -> documents)."""
    root = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(60)
    records = {}
    for encoding, overrides in ENCODINGS.items():
        for mode in MODES:
            for seed in SEEDS:
                results = []
                for k, setting in enumerate(SETTINGS):
                    documents = documents_record(rng, empty_bin=seed == 1 and k == 1)
                    records[(encoding, mode, seed, setting["segment_len"])] = documents
                    loss = documents["token_loss"]
                    metrics = {
                        "loss": loss,
                        "ppl": math.exp(loss),
                        "bpb": loss / math.log(2) / 3.5,
                        "doc_loss": documents["loss"],
                        "beyond_loss": documents["beyond_train_length"]["loss"],
                        "beyond_tokens": documents["beyond_train_length"]["tokens"],
                    }
                    results.append(({**setting, "split": "test", "documents": documents}, metrics))
                make_run(
                    root,
                    [*overrides, *TEXT, f"data.documents={mode}", f"seed={seed}"],
                    experiment="packed_documents",
                    variant={"encoding": encoding, "data.documents": mode, "seed": seed},
                    results=results,
                    spec="../spec.yaml",
                )
    atomic_write_yaml(root / "packed_documents" / "spec.yaml", SPEC)
    return collect(root / "packed_documents"), records


def curves_of(records: dict) -> pd.DataFrame:
    """The expected curves, one row per bin, from the records written (no code under test)."""
    rows = []
    for (encoding, mode, seed, length), documents in records.items():
        curve = documents["position_loss"]
        for k, (lo, hi) in enumerate(zip(EDGES, EDGES[1:])):
            loss = curve["loss"][k]
            rows.append(
                {
                    "encoding": encoding,
                    "data.documents": mode,
                    "seed": seed,
                    "segment_len": length,
                    # SETTINGS: L non-overlapping, 8L sliding
                    "protocol": "sliding" if length == 512 else "non_overlapping",
                    "bin_lo": lo,
                    "bin_hi": hi,
                    "loss": np.nan if loss is None else loss,
                    "tokens": curve["tokens"][k],
                }
            )
    return pd.DataFrame(rows)


def mean_std(values: pd.Series) -> str:
    if values.notna().sum() == 0:
        return "—"
    std = values.std()
    return f"{values.mean():.4f}" + ("" if math.isnan(std) else f" ± {std:.4f}")


def expected_lines(summary: pd.DataFrame, curves: pd.DataFrame) -> list[str]:
    """The rows of the report's three exploratory tables, recomputed with pandas from a summary and
    the per-run curves (bins) at 8L sliding."""
    rows = summary[(summary["experiment"] == "packed_documents") & summary["loss"].notna()]
    lines = []
    for (_, _, encoding, mode), at in rows.groupby(
        ["segment_len", "protocol", "encoding", "data.documents"]
    ):
        cells = [mean_std(at[s]) for s in ("loss", "doc_loss", "beyond_loss", "bpb")]
        lines.append(f"| {encoding} | {mode} | {' | '.join(cells)} |")
    at_l = rows[(rows["segment_len"] == 64) & (rows["protocol"] == "non_overlapping")]
    at_8l = rows[(rows["segment_len"] == 512) & (rows["protocol"] == "sliding")]
    for encoding in sorted(rows["encoding"].unique()):
        cells = []
        for at, statistic in ((at_l, "loss"), (at_8l, "loss"), (at_8l, "beyond_loss")):
            mine = at[at["encoding"] == encoding]
            means = mine.groupby("data.documents")[statistic].mean()
            cells.append(f"{means['packed_reset'] - means['concatenate']:+.4f}")
        lines.append(f"| {encoding} | {' | '.join(cells)} |")
    low = curves[
        (curves["segment_len"] == 512) & (curves["protocol"] == "sliding") & (curves["bin_lo"] < 64)
    ]
    for (encoding, mode), mine in low.groupby(["encoding", "data.documents"]):
        bins = mine.pivot_table(index="seed", columns="bin_lo", values="loss").mean()
        # from L on, pooled per run: the run's beyond_loss at 8L sliding
        beyond = at_8l[(at_8l["encoding"] == encoding) & (at_8l["data.documents"] == mode)]
        cells = [*bins, beyond["beyond_loss"].mean()]
        lines.append(f"| {encoding} | {mode} | {' | '.join(f'{c:.3f}' for c in cells)} |")
    return lines


def assert_row(expected: str, lines: list[str]) -> None:
    """A row of the report with the expected row's labels and numbers, each number within one unit
    of its last decimal (a mean that lies on a rounding boundary may round either way, depending on
    the order its terms were summed in)."""

    def split(line: str) -> tuple[list[str], list[str]]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        labels = [c for c in cells if not re.fullmatch(r"[+-]?\d+\.\d+( ± \d+\.\d+)?", c)]
        return labels, [c for c in cells if c not in labels]

    labels, numbers = split(expected)
    for line in lines:
        if not line.startswith("|"):
            continue
        got_labels, got = split(line)
        if got_labels != labels or len(got) != len(numbers):
            continue
        values = [float(x) for cell in numbers for x in cell.split(" ± ")]
        seen = [float(x) for cell in got for x in cell.split(" ± ")]
        units = [10.0 ** -len(x.split(".")[1]) for cell in numbers for x in cell.split(" ± ")]
        if all(abs(a - b) <= 1.01 * u for a, b, u in zip(values, seen, units)):
            return
    raise AssertionError(f"no row of the report matches {expected}")


def test_curves_are_the_records_of_eval_json(runs):
    frame, records = runs
    curves = document_curves(frame)
    assert len(curves) == len(records) * (len(EDGES) - 1)
    expected = curves_of(records)
    keys = ["encoding", "data.documents", "seed", "segment_len", "bin_lo"]
    merged = curves.merge(expected, on=keys, suffixes=("", "_written"), validate="1:1")
    assert len(merged) == len(expected)
    pd.testing.assert_series_equal(merged["loss"], merged["loss_written"], check_names=False)
    assert (merged["tokens"] == merged["tokens_written"]).all()
    assert (merged["bin_hi"] == merged["bin_hi_written"]).all()
    assert merged["loss"].isna().sum() == len(ENCODINGS) * len(MODES)  # the empty bins
    assert set(curves["protocol"]) == {"non_overlapping", "sliding"}


def test_the_committed_csv_gives_the_same_curves(runs, tmp_path):
    frame, _ = runs
    from_runs = document_curves(frame)
    committed = tmp_path / "committed"
    committed.mkdir()
    frame.to_csv(committed / "summary.csv", index=False)
    summary = read_summary(committed / "summary.csv")
    # the run dirs stay where they were trained
    summary["run_dir"] = [str(tmp_path / "gone" / r) for r in summary["run_id"]]
    with pytest.raises(ConfigError, match="documents: no run has a loss by place"):
        document_curves(summary)
    written, notes = figure(frame, tmp_path / "figures", ("png",), None)
    kept = Path(frame["run_dir"].iloc[0]).parent / "documents.csv"
    assert kept in written and not notes
    shutil.copy(kept, committed / "documents.csv")
    pd.testing.assert_frame_equal(document_curves(summary), from_runs, check_dtype=False)


def test_the_report_tables_are_pandas_means_of_the_runs(runs):
    frame, records = runs
    report = make_report(frame)
    lines = report.splitlines()
    for line in expected_lines(frame, curves_of(records)):  # written by the test: exact
        assert line in lines, line
    assert "## Exploratory: the report's own sections" in report
    assert "differences of means, no test" in report
    assert "The study's own sections (relpos_ablate/studies/packed_documents.py)" in report
    # the tokens row: each bin's count, mean over the runs at 8L sliding
    tokens = curves_of(records).query("segment_len == 512")
    below = tokens[tokens["bin_lo"] < 64].groupby("bin_lo")["tokens"].mean()
    above = tokens[tokens["bin_lo"] >= 64].groupby(["encoding", "data.documents", "seed"]).sum()
    row = [*below, above["tokens"].mean()]
    assert f"| tokens per run (mean) | | {' | '.join(f'{t:.0f}' for t in row)} |" in lines


def test_the_figure_writes_its_files(runs, tmp_path):
    frame, _ = runs
    written, _ = figure(frame, tmp_path, ("png", "pdf"), None)
    png = tmp_path / "documents.png"
    assert png in written and (tmp_path / "documents.pdf") in written
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 0


@pytest.mark.skipif(
    not (RESULTS / "summary.csv").exists(), reason="the study's summary is not committed"
)
def test_the_committed_report_is_pandas_of_its_csv_files():
    summary = read_summary(RESULTS / "summary.csv")
    curves = pd.read_csv(RESULTS / "documents.csv")
    lines = make_report(summary).splitlines()
    for line in expected_lines(summary, curves):
        assert_row(line, lines)
