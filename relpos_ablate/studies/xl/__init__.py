"""Transformer-XL at CPU scale: Table 6 (the ablation, PPL init / best / Attn Len) and Table 8
(RECL), the context probe of a model without memory (`xl_context_cpu`), their reports and the
context figure."""

from relpos_ablate.analysis.layouts import LayoutSpec
from relpos_ablate.studies.xl.figures import save_context_figure, with_control
from relpos_ablate.studies.xl.report import context_report, table6_report
from relpos_ablate.studies.xl.tables import xl_table6, xl_table8

# Table 6 with its fair no-memory control
REPORTS = {
    "xl_table6_cpu": table6_report,
    "xl_context_cpu": context_report,
    ("xl_context_cpu", "xl_table6_cpu"): table6_report,
}
LAYOUTS = {
    # Table 6 reads the RECL ladder's settings as the evaluations at each attention length they are;
    # Table 8 computes RECL from their per-target losses
    "xl_table6": LayoutSpec(xl_table6, reads_token_losses=True),
    "xl_table8": LayoutSpec(xl_table8, reads_token_losses=True),
}


def _context(frame, out, formats, args):
    """plot --kind context: Table 6's runs with the fair control (figures.with_control)."""
    frame, notes = with_control(frame)
    return save_context_figure(frame, out, formats), notes


FIGURES = {"context": _context}
