"""The reports of the Transformer-XL study (analysis/xl_report.py) on frames whose numbers are worked out
here by hand: each model's perplexity at every attention length, measured the way it was trained (memory for
the recurrent rows, sliding windows for the others; the other kind's rows ignored), PPL init and best, and
the comparisons with Welch's t-test; the same report from the frame and from its summary.csv.

Run: .venv/bin/python -m pytest tests/test_xl_report.py -q
"""

import io

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from relpos_ablate.analysis.reports import make_report, read_summary
from relpos_ablate.analysis.xl_report import context_report, ladder_ppl, table6_report
from relpos_ablate.config import ConfigError

# (encoding, memory, loss) -> ppl per seed at c = 16, 64 (the training attention lengths: 16 and 16 + 48)
PPL = {
    ("xl", 48, "full"): {16: [6.0, 6.1, 6.2], 64: [5.0, 5.1, 5.2]},
    ("xl", 0, "full"): {16: [6.5, 6.6, 6.7], 64: [6.4, 6.6, 6.8]},
    ("vaswani", 0, "half"): {16: [8.0, 8.1, 8.2], 64: [20.0, 21.0, 22.0]},
}


def ladder_frame() -> pd.DataFrame:
    rows = []
    for (encoding, memory, loss), by_c in PPL.items():
        for seed in range(3):
            run = {"run_dir": f"{encoding}-{memory}-{loss}-{seed}", "status": "done", "seed": seed, "encoding": encoding,
                   "model.mem_len": memory, "train.loss_on": loss, "train.segment_len": 16, "experiment": "xl_table6_cpu"}
            for k, (c, values) in enumerate(by_c.items()):
                own = {"protocol": "xl", "stride": np.nan, "segment_len": 16, "mem_len": c} if memory else \
                    {"protocol": "sliding", "stride": 1, "segment_len": c, "mem_len": 0}
                rows.append({**run, **own, "attn_len": c, "token_losses": f"setting_{k}", "ppl": values[seed],
                             "tokens": 8192})
                other = {"protocol": "sliding", "stride": 1, "segment_len": c, "mem_len": 0} if memory else \
                    {"protocol": "xl", "stride": np.nan, "segment_len": 16, "mem_len": c}
                rows.append({**run, **other, "attn_len": c, "token_losses": f"other_{k}", "ppl": 99.0, "tokens": 8192})
            rows.append({**run, "protocol": "non_overlapping", "segment_len": 16, "attn_len": 16 + memory,
                         "token_losses": np.nan, "ppl": 42.0, "tokens": 9000})
    return pd.DataFrame(rows)


def test_each_model_is_read_the_way_it_was_trained():
    assert ladder_ppl(ladder_frame()) == PPL  # never the other kind's 99, never the non_overlapping 42


def test_table6_report_by_hand():
    text = table6_report(ladder_frame())
    assert "on the ladder's 8,192 validation targets, mean ± std over 3 seeds" in text
    xl = PPL[("xl", 48, "full")]
    cells = f"{np.mean(xl[16]):.3f} ± {np.std(xl[16], ddof=1):.3f} | {np.mean(xl[64]):.3f} ± {np.std(xl[64], ddof=1):.3f}"
    assert f"| xl, memory 48, full loss | {cells} | 5.100 ± 0.100 (64) | 5.100 ± 0.100 (64) |" in text
    # the no-memory XL row: init at 16 (6.6), best at 64 (6.6 too: equal means, the shorter c wins)
    assert "| xl, no memory, full loss | 6.600 ± 0.100 | 6.600 ± 0.200 | 6.600 ± 0.100 (16) | 6.600 ± 0.100 (16) |" in text
    p = stats.ttest_ind(xl[64], PPL[("xl", 0, "full")][16], equal_var=False).pvalue
    assert (f"- recurrence, XL encoding (full loss), each at its training attention length: xl, memory 48, full loss "
            f"(c = 64) 5.100, xl, no memory, full loss (c = 16) 6.600: xl, memory 48, full loss (c = 64) better "
            f"(Welch p = {p:.2g})") in text
    p64 = stats.ttest_ind(xl[64], PPL[("xl", 0, "full")][64], equal_var=False).pvalue
    assert f"recurrence at equal attention length 64 (memory vs a 64-character window): " in text
    assert f"(Welch p = {p64:.2g})" in text
    assert "- vaswani, no memory, half loss: best at its training attention length, c = 16" in text
    assert "Shaw" not in text.split("Comparisons")[1].split("Longer")[0]  # no Shaw rows: no Shaw comparison


def test_context_report_by_hand():
    ppl = {8: [7.0, 7.1, 7.2], 16: [6.5, 6.6, 6.7], 32: [6.30, 6.31, 6.32], 64: [6.29, 6.33, 6.31]}
    frame = pd.DataFrame([{"status": "done", "protocol": "sliding", "stride": 1, "segment_len": c, "seed": s,
                           "ppl": values[s], "tokens": 8192, "experiment": "xl_context_cpu"}
                          for c, values in ppl.items() for s in range(3)])
    text = context_report(frame)
    assert "| 7.100 ± 0.100 | 6.600 ± 0.100 | 6.310 ± 0.010 | 6.310 ± 0.020 |" in text
    # the same models at two windows: paired over seeds (the differences -0.01, 0.02, -0.01 do not test)
    p = stats.ttest_rel(ppl[64], ppl[32]).pvalue
    assert f"- c = 64 6.310, c = 32 6.310: not significant (paired t-test p = {p:.2g})" in text
    assert "- c = 16 6.600, c = 8 7.100: no test (no spread)" in text  # every seed gains exactly 0.5


def test_the_report_reads_summary_csv_as_the_frame():
    frame = ladder_frame()
    buffer = io.StringIO(frame.to_csv(index=False))
    assert make_report(read_summary(buffer)) == make_report(frame) == table6_report(frame)


def test_no_ladder_no_numbers():
    frame = ladder_frame()
    with pytest.raises(ConfigError, match="no RECL ladder"):
        table6_report(frame[frame["token_losses"].isna()])
