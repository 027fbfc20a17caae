"""The package's import rules (docs/architecture.md, "Import rules"): no two modules import each
other, counting imports inside functions and under TYPE_CHECKING, and a package's __init__ counts as
a module (a submodule that imports its own package while the package imports it back is a knot too).
The check reads every module's imports with `ast`, so it sees what a function-level import would
hide at run time.

Run: .venv/bin/python -m pytest tests/test_architecture.py -q
"""

import ast
import re
from pathlib import Path

import pytest
from torch import nn

from relpos_ablate import AttentionConfig, ModelConfig, TransformerLM
from relpos_ablate.model.schemes import BiasScheme, bias_schemes

PACKAGE = Path(__file__).resolve().parents[1] / "relpos_ablate"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file. `from pkg import name`
    points at pkg.name when that is a module, else at pkg (its __init__)."""
    files = {module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in files
                    else node.module
                    for alias in node.names
                ]
            else:
                continue
            graph[name] |= {target for target in targets if target in files and target != name}
    return graph


def knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that reach each other through imports (strongly connected, more than
    one)."""
    order, low, stack, found = {}, {}, [], []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def test_no_two_modules_of_the_package_import_each_other():
    assert knots(import_graph(PACKAGE)) == []


def test_the_check_finds_a_knot_hidden_in_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text(
        "def helper():\n    from pkg.high import thing  # hidden from import time\n"
    )
    (package / "high.py").write_text("from pkg import low\n\nthing = low\n")
    (package / "alone.py").write_text("import pkg.low\n")
    assert knots(import_graph(package)) == [["pkg.high", "pkg.low"]]


def test_the_check_finds_a_package_and_its_submodule_importing_each_other(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("def build():\n    from pkg.part import Part\n")
    (package / "part.py").write_text("from pkg import build\n")
    assert knots(import_graph(package)) == [["pkg", "pkg.part"]]


def test_bias_schemes_lists_each_scheme_once_shared_or_per_layer():
    for share, expected in ((True, 1), (False, 3)):
        config = ModelConfig(
            vocab_size=8,
            d_model=16,
            n_layers=3,
            n_heads=2,
            d_head=8,
            d_inner=16,
            attention=AttentionConfig(terms="a", bias="kerple_log", share_bias=share),
        )
        model = TransformerLM(config)
        schemes = bias_schemes(model)
        assert len(schemes) == expected and all(isinstance(s, BiasScheme) for s in schemes)
        assert {id(s) for s in schemes} == {
            id(m) for m in model.modules() if isinstance(m, BiasScheme)
        }
    assert bias_schemes(nn.Linear(2, 2)) == []


def test_the_analysis_layer_names_no_study():
    """analysis/ is generic (collect, tables, statistics, rendering, plot primitives): it imports
    nothing of relpos_ablate/studies/ and names no study's experiment or layout; the studies build
    on it."""
    from relpos_ablate import studies

    graph = import_graph(PACKAGE)
    assert not {
        target
        for module, targets in graph.items()
        if module.startswith("relpos_ablate.analysis")
        for target in targets
        if target.startswith("relpos_ablate.studies")
    }
    names = [*(e for s in studies.STUDIES for e in s.experiments), *studies.LAYOUT_NAMES]
    for path in (PACKAGE / "analysis").rglob("*.py"):
        text = path.read_text()
        assert not [n for n in names if re.search(rf"\b{n}\b", text)], path
    assert any(
        target.startswith("relpos_ablate.analysis")
        for module, targets in graph.items()
        if module.startswith("relpos_ablate.studies")
        for target in targets
    )


# ------------------------------------------------- the house (docs/architecture.md)
KERNELS, SCHEMES = "relpos_ablate.model.kernels", "relpos_ablate.model.schemes"
#: how the schemes are named in prose and code (the registry's names are added to these)
SCHEME_WORDS = (
    "FoX",
    "CoPE",
    "FIRE",
    "ALiBi",
    "KERPLE",
    "DAPE",
    "Shaw",
    "stick.breaking",
    "forget",
    "contextual",
    "pair_bias",
    "log_decay",
    "xPos",
    "Sandwich",
)


def _reached(prefix: str, target: str) -> set[tuple[str, str]]:
    graph = import_graph(PACKAGE)
    return {
        (module, t)
        for module, targets in graph.items()
        if module.startswith(prefix)
        for t in targets
        if t.startswith(target)
    }


def test_the_schemes_import_nothing_of_the_kernels():
    """model/kernels/ holds how a call is computed; the schemes say what the scores are (in their
    forms, core/terms.py) and import nothing from it, so a kernel can change without touching a
    scheme."""
    assert len([m for m in import_graph(PACKAGE) if m.startswith(SCHEMES)]) >= 15
    assert not _reached(SCHEMES, KERNELS)


def test_the_kernels_import_no_config_and_no_scheme():
    assert not _reached(KERNELS, "relpos_ablate.config")
    assert not _reached(KERNELS, SCHEMES)


def test_the_runner_imports_no_cli():
    """The one arrow that pointed up: the fork server gets its command from its caller."""
    assert not _reached("relpos_ablate.runner", "relpos_ablate.cli")


def test_no_scheme_is_named_in_the_kernels():
    """Kernels ask for a form, never for a scheme: no scheme's name in their code, docstrings or
    comments."""
    from relpos_ablate.config.registry import BUILTIN_BIASES, BUILTIN_TERMS

    # ('dynamic', an English word, as in dynamic=False)
    names = [*SCHEME_WORDS, *(n for n in (*BUILTIN_BIASES, *BUILTIN_TERMS) if n != "dynamic")]
    pattern = re.compile(rf"\b({'|'.join(names)})\b", re.IGNORECASE)
    path_scheme = re.compile(r"\bPaTH\b")  # (case matters: a path is not PaTH)
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted((PACKAGE / "model" / "kernels").glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) or path_scheme.search(line)
    ]
    assert not found, found


def test_a_terms_own_tensor_is_named_in_its_file_only():
    """FoX's Λ (log_decay) lives in schemes/fox.py: the call carries it inside the term."""
    holders = [p for p in PACKAGE.rglob("*.py") if "log_decay" in p.read_text()]
    assert [p.relative_to(PACKAGE).as_posix() for p in holders] == ["model/schemes/fox.py"]


def test_the_call_is_geometry_and_terms():
    """At most 11 fields, none named after a scheme (the schemes travel as terms; the curve's closed
    form, a function, sits beside the inputs' tensors, which autograd and the kernels map over)."""
    import dataclasses

    from relpos_ablate.model.core.call import AttentionCall

    fields = [f.name for f in dataclasses.fields(AttentionCall)]
    assert len(fields) <= 11, fields
    pattern = re.compile("|".join(SCHEME_WORDS + ("decay", "bias", "linear", "saturation")), re.I)
    assert not [name for name in fields if pattern.search(name)], fields


def test_the_config_lists_no_scheme_names():
    """Which kernels take which schemes is the planner's answer from the schemes' forms
    (relpos_ablate/planner.py), so config/ holds no tuple or list of scheme names but the
    registry's own and the presets (named encodings)."""
    from relpos_ablate.config.registry import BUILTIN_BIASES, BUILTIN_PARTS, BUILTIN_TERMS

    # (`dynamic` is also a kind of RoPE context extension, an evaluation setting's word)
    names = {*BUILTIN_BIASES, *BUILTIN_TERMS, *BUILTIN_PARTS} - {"dynamic"}
    found = []
    for path in (PACKAGE / "config").rglob("*.py"):
        if path.parent.name == "registry" or path.name == "presets.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                listed = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if listed & names:
                    found.append(f"{path.name}:{node.lineno}: {sorted(listed & names)}")
    assert not found, found


def test_no_module_is_over_400_lines():
    long = {
        p.relative_to(PACKAGE).as_posix(): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "blocks", "explicit"])
def test_a_forward_builds_its_attention_call_once(backend, autocast, monkeypatch):
    """One description of a call per forward, on every CPU backend and under autocast: nothing
    rebuilds it (no dataclasses.replace of the call on the way to the kernels)."""
    import torch

    from relpos_ablate import AttentionConfig, RelPosAttention
    from relpos_ablate.model.core.call import AttentionCall

    built = []
    init = AttentionCall.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(AttentionCall, "__init__", counted)
    attn = RelPosAttention(
        16,
        2,
        8,
        AttentionConfig(
            terms="abcd",
            bias="t5",
            forget_gate=True,
            score_scale="log_n",
            log_n_length=8,
            sinks=1,
            backend=backend,
            query_chunk=4,
        ),
    )
    x, mems = torch.randn(2, 9, 16), torch.randn(2, 3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        attn(x, mems)[0].float().sum().backward()
    assert len(built) == 1


def test_the_band_kernel_derives_one_call_for_its_band(monkeypatch):
    """The one exception to a call built once: the band kernel's call for its band (band.banded),
    once a forward."""
    import torch

    from relpos_ablate import AttentionConfig, RelPosAttention
    from relpos_ablate.model.core.call import AttentionCall

    built = []
    init = AttentionCall.__init__
    monkeypatch.setattr(
        AttentionCall,
        "__init__",
        lambda self, *a, **kw: (
            built.append(kw.get("band", (None, None))[1]),
            init(self, *a, **kw),
        )[1],
    )
    attn = RelPosAttention(
        16,
        2,
        8,
        AttentionConfig(terms="ab", rel="learned", clamp_len=2, backend="band", query_chunk=4),
    )
    attn(torch.randn(2, 9, 16))[0].sum().backward()
    assert built == [None, 2]


# Where each backend sums the score terms: `sum_terms` (call.py) on every dense path,
# StridedMaps.mask on the per-distance layout (term b and the curves added per distance, then laid
# out as a view), FlexAttention's point-wise twin, built by `_per_distance_mod` (flex.py:
# FlexAttention traces the score_mod it returns rather than calling it, so the builder is what a
# profile sees)
SUM_SITES = {
    ("call.py", "sum_terms"),
    ("block_maps.py", "additive_map"),
    ("flex.py", "_per_distance_mod"),
}
HOP_CASES = {  # name: (config fields, forward options, the sum site the case reaches)
    "explicit": (dict(terms="abcd", bias="t5", backend="explicit"), {}, "sum_terms"),
    "stored_sdpa": (dict(terms="abcd", bias="alibi", backend="sdpa"), {}, "sum_terms"),
    "blocks_strided": (dict(terms="a", bias="alibi", backend="blocks"), {}, "additive_map"),
    "blocks_materialised": (dict(terms="a", forget_gate=True, backend="blocks"), {}, "sum_terms"),
    "statistics": (dict(terms="abcd", bias="t5"), {"statistics": True}, "sum_terms"),
    "materialised_seam": (
        dict(terms="a", normaliser="stick_breaking", bias="none"),
        {},
        "sum_terms",
    ),
    "flex_eager": (dict(terms="a", bias="alibi", backend="flex", sinks=1), {}, "_per_distance_mod"),
}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", list(HOP_CASES))
def test_at_most_four_calls_from_forward_to_the_score_sum(case):
    """The issue's measure of the attention core: from RelPosAttention.forward to where the score
    terms are summed, at most 4 calls of the package's own functions on every backend (torch's
    frames in between, such as autograd.Function.apply or FlexAttention's vmap, and comprehensions
    are not counted)."""
    import sys

    import torch

    from relpos_ablate import RelPosAttention
    from relpos_ablate.model.core.options import AttentionOptions

    class Statistics:  # a StatisticsSink that keeps nothing
        def add(self, view, probs):
            pass

    fields, options, site = HOP_CASES[case]
    attn = RelPosAttention(16, 2, 8, AttentionConfig(query_chunk=4, **fields))
    if options.get("statistics"):
        options = {"statistics": Statistics()}
    x, mems = torch.randn(2, 9, 16), torch.randn(2, 3, 16)
    forward, package = RelPosAttention.forward.__code__, str(PACKAGE)
    reached = []

    def hops(frame) -> int | None:
        count = 0
        while frame is not None:
            if frame.f_code is forward:
                return count
            # a comprehension's frame (<listcomp>, <genexpr>) is no call a reader follows
            count += frame.f_code.co_filename.startswith(
                package
            ) and not frame.f_code.co_name.startswith("<")
            frame = frame.f_back
        return None

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and (Path(code.co_filename).name, code.co_name) in SUM_SITES:
            reached.append((code.co_name, hops(frame)))

    flex = fields.get("backend") == "flex"
    sys.setprofile(profile)
    try:
        # FlexAttention has no backward on CPU
        with torch.no_grad() if flex else torch.enable_grad():
            attn(x, None if flex else mems, AttentionOptions(**options))
    finally:
        sys.setprofile(None)
    at_site = [n for name, n in reached if name == site and n is not None]
    assert at_site, f"{case} never reached {site}: {reached}"
    assert max(at_site) <= 4, reached


def test_no_test_module_imports_another():
    """Helpers shared by tests live in tests/fixtures/, never in another test module."""
    tests = Path(__file__).resolve().parent
    found = [
        f"{path.relative_to(tests)}:{node.lineno}"
        for path in tests.rglob("test_*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom | ast.Import)
        and any(
            name.startswith("test_")
            for name in (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
            )
        )
    ]
    assert not found, found
