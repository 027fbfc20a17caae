"""The reports of the Transformer-XL study (relpos_ablate/studies/xl/report.py) on frames whose
numbers are worked out here by hand: each model's perplexity at every attention length, measured the
way it was trained (memory for the recurrent rows, sliding windows for the others; the other kind's
rows ignored), PPL init and best, and the comparisons: Table 6's (two models: Welch's t-test), each
model's best attention length against its training one and the context probe's doublings (the same
runs: a paired t-test), each list one family, Holm-corrected. Every p, adjusted p, difference and
95% CI is computed here with scipy and statsmodels from the fixture's numbers; the same report from
the frame and from its summary.csv.

Run: .venv/bin/python -m pytest tests/studies/test_xl_report.py -q
"""

import io

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from fixtures.xl_study import CONTROL, PPL, control_rows, ladder_frame
from relpos_ablate.analysis.collect import read_summary
from relpos_ablate.config import ConfigError
from relpos_ablate.studies import make_report
from relpos_ablate.studies.xl.report import (
    context_report,
    ladder_ppl,
    ladder_samples,
    table6_report,
)


def test_each_model_is_read_the_way_it_was_trained():
    # never the other kind's 99, never the non_overlapping 42
    assert ladder_ppl(ladder_frame()) == PPL
    # the same numbers keyed by the run each comes from: what pairs a model's values at two
    # attention lengths
    assert ladder_samples(ladder_frame()) == {
        (encoding, memory, loss): {
            c: {f"{encoding}-{memory}-{loss}-{seed}": v for seed, v in enumerate(values)}
            for c, values in by_c.items()
        }
        for (encoding, memory, loss), by_c in PPL.items()
    }


def ttest(a, b, paired: bool):
    """The test of a against b computed here: scipy's paired t-test over the seeds (a and b in seed
    order, the same runs) or Welch's (two models)."""
    return stats.ttest_rel(a, b) if paired else stats.ttest_ind(a, b, equal_var=False)


def holm(p_values: list[float]) -> list[float]:
    """A family's Holm-adjusted p-values, computed here with statsmodels."""
    return list(multipletests(p_values, alpha=0.05, method="holm")[1])


def line(name_a: str, a, name_b: str, b, paired: bool, p_adjusted: float) -> str:
    """The comparison as the report states it (lower perplexity is better, 3 decimals for the means
    and 4 for the difference), every number computed here: the means, the verdict the adjusted p
    supports, the difference with its 95% CI, n, the raw and the Holm-adjusted p."""
    result = ttest(a, b, paired)
    p, (low, high) = result.pvalue, result.confidence_interval(0.95)
    difference = np.mean(np.subtract(a, b)) if paired else np.mean(a) - np.mean(b)
    if p_adjusted < 0.05:
        said = f"{name_a if difference < 0 else name_b} better"
    else:
        said = "not significant after correction" if p < 0.05 else "not significant"
    kind = "paired t-test" if paired else "Welch's t-test"
    return (
        f"{name_a} {np.mean(a):.3f}, {name_b} {np.mean(b):.3f}: {said} ({kind}, difference "
        f"{difference:.4f}, 95% CI [{low:.4f}, {high:.4f}], n = {len(a)}; p = {p:.2g}, "
        f"Holm-adjusted p = {p_adjusted:.2g})"
    )


def test_table6_report_by_hand():
    text = table6_report(ladder_frame())
    assert "on the ladder's 8,192 validation targets, mean ± std over 3 seeds" in text
    xl = PPL[("xl", 48, "full")]
    cells = (
        f"{np.mean(xl[16]):.3f} ± {np.std(xl[16], ddof=1):.3f} | {np.mean(xl[64]):.3f} ± "
        f"{np.std(xl[64], ddof=1):.3f}"
    )
    assert (
        f"| xl, memory 48, full loss | {cells} | 5.100 ± 0.100 (64) | 5.100 ± 0.100 (64) |" in text
    )
    # the no-memory XL row: init at 16 (6.6), best at 64 (6.6 too: equal means, the shorter c wins)
    assert (
        "| xl, no memory, full loss | 6.600 ± 0.100 | 6.600 ± 0.200 | 6.600 ± 0.100 (16) | "
        "6.600 ± 0.100 (16) |" in text
    )
    # Table 6's family: the comparisons whose two rows are here (no Shaw, no half-loss XL, no
    # Al-Rfou), two models each (Welch). With memory the training (and best) attention length is 64,
    # without it 16.
    nomem = PPL[("xl", 0, "full")]
    # "each at its best" asks for the cells of "each at its training" (both rows best there): tested
    # once
    at_16 = line(
        "xl, memory 48, full loss (c = 64)",
        xl[64],
        "xl, no memory, full loss (c = 16)",
        nomem[16],
        paired=False,
        p_adjusted=ttest(xl[64], nomem[16], paired=False).pvalue,
    )
    assert "xl, memory 48, full loss (c = 64) better" in at_16  # p ~ 5e-5
    assert (
        f"- recurrence, XL encoding (full loss), each at its training attention length: {at_16}"
        in text
    )
    assert (
        "- recurrence, XL encoding (full loss), each at its best attention length: the cells of "
        '"recurrence, XL encoding (full loss), each at its training attention length" above, not '
        "tested twice"
    ) in text
    # memory against a model trained on 16 but scored with a 64-character window measures
    # extrapolation: not asked
    assert "(c = 64) 6.600" not in text and "equal attention length" not in text
    assert (
        "Family \"Table 6's comparisons\": 1 test (Welch's t-test), Holm-corrected at α = 0.05; "
        "an ordering is stated only where the adjusted p < 0.05."
    ) in text
    assert "- vaswani, no memory, half loss: best at its training attention length, c = 16" in text
    # no Shaw rows: no Shaw comparison
    assert "Shaw" not in text.split("Comparisons")[1].split("Longer")[0]
    # every model is best at its training attention length: nothing to test in the second family
    longer = text.split("Longer attention")[1]
    assert (
        'Family "each model at its best attention length vs its training one": 0 tests (none run)'
        in longer
    )
    assert "Power: no test was run." in longer


def test_table6_report_with_the_fair_control_compares_memory_at_equal_training_context():
    """Read with xl_context_cpu's runs, Table 6 gains the fair control's row (no memory, trained on
    64, at its windows) and the family gains memory against it at c = 64 (two models: Welch), Holm
    over both tests."""
    frame = pd.concat([ladder_frame(), control_rows()], ignore_index=True)
    text = make_report(frame)
    assert text == table6_report(frame)  # the combined experiments have Table 6's report
    cell = lambda values: f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"  # noqa: E731
    assert (
        f"| xl, no memory, full loss, trained on 64 (xl_context_cpu) | {cell(CONTROL[16])} | "
        f"{cell(CONTROL[64])} | {cell(CONTROL[64])} (64) | {cell(CONTROL[64])} (64) |"
    ) in text
    xl, nomem = PPL[("xl", 48, "full")], PPL[("xl", 0, "full")]
    adjusted = holm(
        [
            ttest(xl[64], nomem[16], paired=False).pvalue,
            ttest(xl[64], CONTROL[64], paired=False).pvalue,
        ]
    )
    fair = line(
        "xl, memory 48, full loss (c = 64)",
        xl[64],
        "xl, no memory, full loss, trained on 64 (c = 64)",
        CONTROL[64],
        paired=False,
        p_adjusted=adjusted[1],
    )
    assert (
        "- memory vs no memory at equal keys and equal training context (the fair control: no "
        "memory, trained on 64-character segments, its window 64): " + fair
    ) in text
    assert 'Family "Table 6\'s comparisons": 2 tests' in text
    base = np.mean(xl[64])
    assert f"Relative to the perplexity of XL with memory ({base:.3f})" in text


# the no-memory models read lower at c = 64 than at their training 16: their best is the longer
# attention length
LONGER = {
    **PPL,
    ("xl", 0, "full"): {16: [6.5, 6.6, 6.7], 64: [6.2, 6.25, 6.4]},
    ("vaswani", 0, "half"): {16: [8.0, 8.1, 8.2], 64: [7.9, 8.05, 8.1]},
}


def test_best_against_training_attention_length_is_paired_and_corrected():
    """Each model at its best attention length against its training one: the same runs at two
    lengths, so a paired t-test over the seeds (never Welch's), and the family of these tests
    Holm-corrected together."""
    text = table6_report(ladder_frame(LONGER)).split("Longer attention")[1]
    models = {
        ("xl", 0, "full"): "xl, no memory, full loss",
        ("vaswani", 0, "half"): "vaswani, no memory, half loss",
    }
    adjusted = dict(
        zip(
            models,
            holm([ttest(LONGER[key][64], LONGER[key][16], paired=True).pvalue for key in models]),
        )
    )
    for key, label in models.items():
        expected = line(
            "c = 64",
            LONGER[key][64],
            "c = 16",
            LONGER[key][16],
            paired=True,
            p_adjusted=adjusted[key],
        )
        assert f"- {label}: {expected}" in text
    # pairing matters: Vaswani's seeds each gain 0.05-0.1 at c = 64, which the paired test finds
    # (its one family-mate is far stronger, so Holm leaves it below 0.05) and Welch's test, blind to
    # the pairing, would not
    vaswani = LONGER[("vaswani", 0, "half")]
    assert (
        adjusted[("vaswani", 0, "half")]
        < 0.05
        < stats.ttest_ind(vaswani[64], vaswani[16], equal_var=False).pvalue
    )
    assert (
        "- vaswani, no memory, half loss: c = 64 8.017, c = 16 8.100: c = 64 better (paired t-test"
        in text
    )
    assert "- xl, memory 48, full loss: best at its training attention length, c = 64" in text
    assert (
        'Family "each model at its best attention length vs its training one": 2 tests '
        "(paired t-test)" in text
    )
    assert "Welch" not in text


def test_context_report_by_hand():
    ppl = {8: [7.0, 7.1, 7.2], 16: [6.5, 6.6, 6.7], 32: [6.30, 6.31, 6.32], 64: [6.29, 6.33, 6.31]}
    frame = pd.DataFrame(
        [
            {
                "run_dir": f"nomem-{s}",
                "status": "done",
                "protocol": "sliding",
                "stride": 1,
                "segment_len": c,
                "seed": s,
                "ppl": values[s],
                "tokens": 8192,
                "experiment": "xl_context_cpu",
            }
            for c, values in ppl.items()
            for s in range(3)
        ]
    )
    text = context_report(frame)
    assert "| 7.100 ± 0.100 | 6.600 ± 0.100 | 6.310 ± 0.010 | 6.310 ± 0.020 |" in text
    # the same models at two windows: paired over seeds. 16 against 8 has no test (every seed gains
    # exactly 0.5: no spread), so the family is the other two doublings, Holm-corrected together
    assert np.ptp(np.subtract(ppl[16], ppl[8])) == 0
    assert "- c = 16 6.600, c = 8 7.100: no test (no spread)" in text
    doublings = [(32, 16), (64, 32)]
    adjusted = holm([ttest(ppl[long], ppl[short], paired=True).pvalue for long, short in doublings])
    for (long, short), p_adjusted in zip(doublings, adjusted):
        assert (
            "- "
            + line(
                f"c = {long}",
                ppl[long],
                f"c = {short}",
                ppl[short],
                paired=True,
                p_adjusted=p_adjusted,
            )
            in text
        )
    # 32 against 16: p ~ 0.03 alone, not below 0.05 once corrected for the family's two tests
    assert ttest(ppl[32], ppl[16], paired=True).pvalue < 0.05 <= adjusted[0]
    assert "- c = 32 6.310, c = 16 6.600: not significant after correction (paired t-test" in text
    assert (
        'Family "each doubling of the window": 2 tests (paired t-test), Holm-corrected at α = 0.05'
        in text
    )


def test_the_report_reads_summary_csv_as_the_frame():
    frame = ladder_frame()
    buffer = io.StringIO(frame.to_csv(index=False))
    assert make_report(read_summary(buffer)) == make_report(frame) == table6_report(frame)


def test_no_ladder_no_numbers():
    frame = ladder_frame()
    with pytest.raises(ConfigError, match="no RECL ladder"):
        table6_report(frame[frame["token_losses"].isna()])
