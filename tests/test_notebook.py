"""notebooks/inspect.ipynb executed with nbclient on a results dir of two really trained tiny runs
(built by the training code in the test): it must run without errors, show the same table numbers
as collect(), and draw the extrapolation, bias, attention and term figures of the chosen run.

Run: .venv/bin/python -m pytest tests/test_notebook.py -q
"""

import nbformat

from fixtures.notebook import NOTEBOOK, run_notebook
from fixtures.report_runs import trained_results
from relpos_ablate.analysis import collect


def outputs(nb, kind):
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if kind(o)]


def test_notebook_runs_on_a_trained_results_dir(monkeypatch):
    results = trained_results()
    df = collect(results)
    xl = df.loc[df["encoding"] == "xl", "run_id"].iloc[0]
    committed = nbformat.read(NOTEBOOK, as_version=4)
    # committed clean
    assert all(not cell.get("outputs") for cell in committed.cells if cell.cell_type == "code")
    nb = run_notebook(results, xl, monkeypatch)

    markdown = "".join(
        o["data"]["text/markdown"]
        for o in outputs(nb, lambda o: "text/markdown" in o.get("data", {}))
    )
    for enc in ("xl", "alibi"):
        for length in (16, 32):
            acc = df.loc[(df["encoding"] == enc) & (df["segment_len"] == length), "acc"].iloc[0]
            assert f"{acc:.3f}" in markdown
    assert markdown.startswith("| encoding | eval len 16 | eval len 32 |")
    printed = "".join(
        o.get("text", "") for o in outputs(nb, lambda o: o["output_type"] == "stream")
    )
    assert f"run {xl} " in printed and "2 runs, 4 rows" in printed and "mem_len: 16" in printed
    images = outputs(nb, lambda o: "image/png" in o.get("data", {}))
    assert len(images) == 4  # extrapolation, bias curves (term d), attention heatmaps, score terms
