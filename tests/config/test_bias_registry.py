"""The bias registry (relpos_ablate/config/registry/builtins.py) is the one list of bias names:
validation, `--help`, presets and the model read it; built-ins resolve lazily without torch; every
built-in has its formula in docs/schemes/distance-biases.md and an independent one in
tests/fixtures/reference.py; a scheme registered from outside the package (the worked example's
Gaussian, docs/extending/new-bias.md) is as good as a built-in. Structural properties that need no
reference formula (kernels agree, causality, memory, translation invariance) run on every registered
scheme. Run: pytest tests/config/test_bias_registry.py -q"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.attention import assert_memory_and_causality_exact, randomize
from fixtures.docs_scheme import registered_example
from fixtures.reference import BIAS_FORMULAS, TERM_FORMULAS
from relpos_ablate import AttentionConfig, ModelConfig, RelPosAttention, TransformerLM
from relpos_ablate.config import ConfigError, RunConfig, describe, load_run_config, registry
from relpos_ablate.config.attention import BIAS_TYPES
from relpos_ablate.config.presets import preset_fields, presets
from relpos_ablate.config.registry import (
    BUILTIN_BIASES,
    BUILTIN_TERMS,
    bias_class,
    bias_types,
    import_modules,
    register_bias,
)
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.schemes import BiasScheme, build_bias

REPO = Path(__file__).resolve().parents[2]
SCHEMES = [
    *BUILTIN_BIASES,
    "gaussian",
]  # every built-in and the worked example's scheme of one's own


@pytest.fixture(scope="module")
def gaussian(tmp_path_factory):
    """The worked example's GaussianBias, registered from a module outside the package for this
    file's tests."""
    with registered_example(tmp_path_factory.mktemp("user")) as module:
        yield module


@pytest.fixture
def fresh_registry(monkeypatch):
    """Only the built-ins are registered during the test, and what it registers is gone
    afterwards."""
    monkeypatch.setattr(registry, "_registered", {})


# ------------------------------------------------------------------ the list of names
def test_the_names_are_none_then_the_builtins_and_resolve_lazily_to_bias_schemes(fresh_registry):
    assert bias_types() == BIAS_TYPES == ("none", *BUILTIN_BIASES)
    assert build_bias(AttentionConfig(bias="none"), 4) is None
    for name, entry in BUILTIN_BIASES.items():
        cls = bias_class(name)
        assert issubclass(cls, BiasScheme)
        assert f"{cls.__module__}:{cls.__qualname__}" == entry.target
        assert entry.target.startswith("relpos_ablate.model.schemes.")
        assert type(build_bias(AttentionConfig(bias=name), 3)) is cls
        # the registry line's forms (read without torch) are the class's
        assert frozenset(entry.forms.split()) == cls.forms, name


def test_every_builtin_has_an_independent_reference_formula_and_a_documented_one():
    assert set(BIAS_FORMULAS) == set(BUILTIN_BIASES), (
        "every built-in bias type needs a float64 formula in BIAS_FORMULAS of "
        "tests/fixtures/reference.py"
    )
    assert set(TERM_FORMULAS) == set(BUILTIN_TERMS), (
        "every built-in score-term scheme needs a float64 formula in TERM_FORMULAS of "
        "tests/fixtures/reference.py"
    )
    doc = (REPO / "docs" / "schemes" / "distance-biases.md").read_text()
    section = doc.split("\n## Bias types", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^### `(\w+)`", section, flags=re.M)
    assert documented == list(BUILTIN_BIASES), (
        "docs/schemes/distance-biases.md: one '### `name`' section per built-in, in order"
    )


def test_an_unregistered_name_is_one_line_naming_the_registry(fresh_registry):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["model.attention.bias=gaussian"])
    message = str(err.value)
    assert message.startswith(
        "model.attention.bias: 'gaussian' is not registered; registered: none, xl_table, t5"
    )
    assert "@register_bias in a module listed under `imports:`" in message and "\n" not in message
    with pytest.raises(ConfigError, match="did you mean 'alibi'"):
        AttentionConfig(bias="alibj")


def test_help_lists_the_registered_names(gaussian):
    (doc,) = [doc for path, _default, doc in describe(RunConfig) if path == "model.attention.bias"]
    assert doc.endswith("Allowed: " + " | ".join([*BIAS_TYPES, "gaussian"]) + ".")


def test_config_validation_and_grid_expansion_never_import_torch():
    """`grid` reruns and `status` stay fast: validating every built-in, expanding a grid of them and
    `--help`'s field list must not import torch (the registry names built-ins as text)."""
    code = (
        "import sys\n"
        "from relpos_ablate.config import AttentionConfig, RunConfig, describe\n"
        "from relpos_ablate.config.registry import BUILTIN_BIASES\n"
        "from relpos_ablate.runner.grid import load_grid\n"
        "[AttentionConfig(bias=name) for name in BUILTIN_BIASES]\n"
        "spec = load_grid('experiments/bias_types.yaml')\n"
        "describe(RunConfig)\n"
        "assert {r.config.model.attention.bias for r in spec.runs} > set(BUILTIN_BIASES)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ register_bias and imports
@pytest.mark.parametrize(
    "name, phrase",
    [
        ("alibi", "'alibi' is built in"),
        ("none", "'none' is built in"),
        ("Gauss", "lowercase letters"),
        ("a-b", "lowercase letters"),
        (3, "lowercase letters"),
    ],
)
def test_register_bias_refuses_names_that_cannot_be_yours(fresh_registry, name, phrase):
    with pytest.raises(ValueError, match=phrase):
        register_bias(name)


def test_register_bias_takes_one_class_per_name(fresh_registry):
    class Mine(BiasScheme):
        pass

    class Other(BiasScheme):
        pass

    assert register_bias("mine")(Mine) is Mine
    assert register_bias("mine")(Mine) is Mine  # the same class again (a module reloaded) is fine
    with pytest.raises(
        ValueError, match=r"'mine' is already registered by test_bias_registry:.*Mine"
    ):
        register_bias("mine")(Other)
    with pytest.raises(ValueError, match="decorates a class"):
        register_bias("other")(lambda n_heads, config: None)
    assert bias_types()[-1] == "mine" and preset_fields("mine") == {
        "terms": "a",
        "absolute": "none",
        "bias": "mine",
    }


def test_a_registered_class_must_be_a_bias_scheme(fresh_registry):
    register_bias("plain")(torch.nn.Identity)
    with pytest.raises(
        TypeError, match="bias 'plain': torch.nn.modules.linear.Identity must subclass"
    ):
        build_bias(AttentionConfig(bias="plain"), 2)


def test_a_bias_named_like_a_baseline_preset_is_refused_by_the_grid(fresh_registry):
    register_bias("rope")(type("RopeBias", (BiasScheme,), {}))
    with pytest.raises(
        ConfigError,
        match="^encoding: bias type 'rope' has the name of a baseline or schedule preset",
    ):
        presets()


@pytest.mark.parametrize(
    "imports, field, phrase",
    [
        ("my_schemes", "imports", "expected a list of module names"),
        (
            ["my_schemes.py"],
            "imports[0]",
            "give a Python module name such as 'my_schemes', not a file path",
        ),
        (["ok", "dir/my_mod.py"], "imports[1]", "such as 'my_mod'"),
        (
            ["no_such_module_here"],
            "imports[0]",
            "cannot import 'no_such_module_here' (ModuleNotFoundError",
        ),
    ],
)
def test_bad_imports_are_one_line_naming_the_entry(tmp_path, monkeypatch, imports, field, phrase):
    (tmp_path / "ok.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        import_modules(imports)
    assert (
        str(err.value).startswith(f"{field}: ")
        and phrase in str(err.value)
        and "\n" not in str(err.value)
    )


def test_a_module_that_fails_on_import_is_reported_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_schemes.py").write_text(
        "from relpos_ablate import register_bias\nregister_bias('t5')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError,
        match=r"^imports\[0\]: cannot import 'broken_schemes' \(ValueError: "
        r"register_bias: 't5' is built in",
    ):
        load_run_config(None, ["imports=[broken_schemes]"])
    sys.modules.pop("broken_schemes", None)


def test_imports_are_imported_before_the_model_is_validated(fresh_registry, tmp_path, monkeypatch):
    """The bias name may come before `imports:` in the file: the modules are imported first."""
    (tmp_path / "late_schemes.py").write_text(
        "from relpos_ablate.model.schemes import BiasScheme, register_bias\n"
        "register_bias('late')(type('LateBias', (BiasScheme,), {}))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_schemes", raising=False)
    config = load_run_config(None, ["model.attention.bias=late", "imports=[late_schemes]"])
    assert config.imports == ("late_schemes",) and config.model.attention.bias == "late"
    sys.modules.pop("late_schemes")


# ------------------------------------------------------------------ structure, on every registered
# scheme
def attention(name, **fields):
    attn = RelPosAttention(
        16, 2, 8, AttentionConfig(bias=name, max_distance=6, num_buckets=8, **fields)
    ).double()
    randomize(attn, 1)
    return attn


def lm(name, mem_len):
    config = ModelConfig(
        vocab_size=11,
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_head=8,
        d_inner=32,
        dropout=0.0,
        mem_len=mem_len,
        attention=AttentionConfig(terms="ac", bias=name, max_distance=6, num_buckets=8),
    )
    model = TransformerLM(config).double().eval()
    randomize(model, 2, scale=0.3)
    return model


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_every_kernel_matches_the_explicit_scores(gaussian, name, causal):
    """Forward and gradients of the block kernels equal autograd through the materialised scores,
    and the FlexAttention path's forward (CPU, eager) equals them too."""
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    mems = torch.randn(2, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    explicit = attention(name, terms="ac", causal=causal, backend="explicit", query_chunk=2)
    expected = explicit(x, mems)[0]
    grads = torch.autograd.grad(expected.square().sum(), list(explicit.parameters()))
    for backend in ("blocks", "sdpa"):
        fast = attention(name, terms="ac", causal=causal, backend=backend, query_chunk=2)
        out = fast(x, mems)[0]
        torch.testing.assert_close(out, expected, rtol=1e-7, atol=1e-10)
        for g, ref in zip(torch.autograd.grad(out.square().sum(), list(fast.parameters())), grads):
            torch.testing.assert_close(g, ref, rtol=1e-7, atol=1e-10)
    flex = attention(name, terms="ac", causal=causal, backend="flex")
    with torch.no_grad():
        torch.testing.assert_close(flex(x, mems)[0], expected, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("name", SCHEMES)
def test_memory_and_causality_are_exact(gaussian, name):
    """Segment 2 with memory equals the tail of one long pass; later tokens never change earlier
    outputs."""
    assert_memory_and_causality_exact(lm(name, mem_len=6))


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_distance_only_schemes_are_translation_invariant(gaussian, name, causal):
    """Four masked-out keys in front shift every position by 4 and change nothing."""
    attn = attention(name, terms="ac", causal=causal)
    if not attn.bias_scheme.distance_only:
        pytest.skip(f"{name} depends on the query position, not on i - j alone")
    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    front = torch.zeros(2, 10, dtype=torch.bool)
    front[:, :4] = True
    torch.testing.assert_close(
        attn(
            x, torch.randn(2, 4, 16, dtype=torch.float64), AttentionOptions(key_padding_mask=front)
        )[0],
        attn(x)[0],
    )


# ------------------------------------------------------------------ the score-term schemes
def test_every_builtin_term_is_a_term_scheme_with_the_forms_its_registry_line_says():
    """The registry's text (read without torch by the config checks) and the class agree: the
    target, the forms of the terms it makes, and the switch is a field of AttentionConfig."""
    from relpos_ablate.config.registry import BUILTIN_TERMS, term_class
    from relpos_ablate.model import ScoreTerm, TermScheme

    for name, entry in BUILTIN_TERMS.items():
        cls = term_class(name)
        assert issubclass(cls, TermScheme) and issubclass(cls.Term, ScoreTerm)
        assert f"{cls.__module__}:{cls.__qualname__}" == entry.target
        assert frozenset(entry.forms.split()) == cls.Term.forms, name
        assert entry.switch.partition("=")[0] in AttentionConfig.__dataclass_fields__
        # each form it declares is implemented, and none it does not declare
        for form, method in (("key_offsets", "key_offsets"), ("band", "band_width")):
            overridden = getattr(cls.Term, method) is not getattr(ScoreTerm, method)
            assert overridden == (form in cls.Term.forms), (name, form)
        assert (cls.Term.hand_gradient is not ScoreTerm.hand_gradient) == ("hand" in cls.Term.forms)


@pytest.mark.parametrize("name, switch", [("fox", "forget_gate"), ("cope", "cope_positions")])
def test_a_builtin_term_is_switched_on_by_its_own_field_not_by_term_schemes(name, switch):
    """Its own field carries its settings and checks (CoPE's table size, FoX's causality)."""
    with pytest.raises(ConfigError, match=rf"term_schemes\[0\]: '{name}' is built in: .*{switch}"):
        AttentionConfig(terms="a", term_schemes=(name,))
