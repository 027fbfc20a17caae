"""Results dir -> pandas (collect) -> paper-style tables (tables, render) and figures (plots,
figures)."""

from relpos_ablate.analysis.collect import collect
from relpos_ablate.analysis.layouts import make_table
from relpos_ablate.analysis.table_options import TableOptions

__all__ = ["TableOptions", "collect", "make_table"]
