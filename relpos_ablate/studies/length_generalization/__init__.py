"""Length generalization (Kazemnejad et al. 2023, Ruoss et al. 2023 style): the table layout with
its rank summary, the report, the main figure (exact match against n), attention diagnostics and
passkey."""

from relpos_ablate.analysis.layouts import LayoutSpec
from relpos_ablate.studies.length_generalization.curves import save_lengthgen
from relpos_ablate.studies.length_generalization.figures import save_diagnostics
from relpos_ablate.studies.length_generalization.passkey import save_passkey
from relpos_ablate.studies.length_generalization.report import length_generalization_report
from relpos_ablate.studies.length_generalization.table import (
    length_generalization_table,
    rank_table,
)

# with the step-cap runs
REPORTS = {
    "length_generalization": length_generalization_report,
    ("length_generalization", "length_generalization_cap"): length_generalization_report,
}
LAYOUTS = {
    "length_generalization": LayoutSpec(
        length_generalization_table,
        appendix=lambda data, options, orders: rank_table(
            data, options.metric, list(options.rows), orders
        ),
    )
}
FIGURES = {
    "lengthgen": lambda frame, out, formats, args: (
        save_lengthgen(frame, out, args.metric, formats),
        [],
    ),
    "diagnostics": lambda frame, out, formats, args: (save_diagnostics(frame, out, formats), []),
    "passkey": lambda frame, out, formats, args: (
        save_passkey(frame, out, args.metric, formats),
        [],
    ),
}
