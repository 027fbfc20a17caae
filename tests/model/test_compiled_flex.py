"""The compiled FlexAttention path on CPU: torch.compile(flex_attention) generates a C++ kernel
(gcc), the kernel CUDA runs too, and finds what eager flex cannot (captured tensors, graph breaks,
recompilation, dtype rules). CPU FlexAttention has no backward: forward only, in fp32, equal to the
explicit path.

Every score_mod ingredient of flex.py is compiled once, and every scheme that uses it runs through
the same compiled kernel (a new scheme of the same structure must not recompile): term b with every
bias type, FIRE's MLP per pair, FoX's decay, log-n and the learned temperature, sinks, windows, key
padding, memory, explicit positions, bidirectional attention, RoPE and its variants (rotated before
the kernel: on FoX's). 8 graphs (dynamo's count): ~60 s the first time alone on this project's
2-core machine, ~90 s beside other tests, ~15 s once torch's compile cache holds them. Run: pytest
tests/model/test_compiled_flex.py -q"""

import functools

import pytest
import torch
import torch._dynamo

from fixtures.attention import drawn, randomize
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config.attention import BIAS_TYPES
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.kernels import flex
from relpos_ablate.model.schemes import RopeScaling

pytest.importorskip("torch.nn.attention.flex_attention")
LQ, MEM = 6, 3
FOX = dict(
    terms="a",
    forget_gate=True,
    score_scale="log_n",
    log_n_length=4,
    learned_temperature=True,
    bias="alibi",
)
CASES = {  # name -> (attention fields, call options, explicit positions)
    "xl_window_sinks_padded": (dict(terms="abcd", window=4, sinks=2), dict(padded=True), False),
    "fox_log_n_tau_alibi": (FOX, dict(padded=True), False),
    "explicit_xl_fire_fox": (
        dict(terms="abcd", bias="fire", forget_gate=True, window=5),
        dict(padded=True),
        True,
    ),
    "bidirectional_kerple": (
        dict(terms="abcd", bias="kerple_power", causal=False),
        dict(padded=True),
        False,
    ),
    "bidirectional_fire": (dict(terms="a", bias="fire", causal=False), dict(), False),
    # RoPE rotates q and k before the kernel: its cases add it to FoX's, whose compiled kernel they
    # reuse
    "rope_xpos": (
        dict(FOX, absolute="rope", rope_fraction=0.5, xpos_scale_base=6.0),
        dict(padded=True),
        False,
    ),
    "rope_yarn": (
        dict(FOX, absolute="rope"),
        dict(padded=True, rope_scaling=RopeScaling("yarn", 3.0, original_length=4)),
        False,
    ),
}


@functools.cache
def compiled_kernel():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@pytest.fixture
def compiled(monkeypatch):
    """backend 'flex' on CPU through the compiled kernel (dispatch.py compiles it on CUDA only);
    yields a function returning the number of graphs compiled so far."""
    monkeypatch.setattr(flex, "compiles", lambda q: True)  # and so FIRE's compiled_pair_score
    monkeypatch.setattr(flex, "_kernel", lambda compiled: compiled_kernel())
    return lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]


def make(fields, seed=0, **extra):
    attn = RelPosAttention(16, 2, 8, AttentionConfig(**{"query_chunk": 2, **fields, **extra}))
    # the kernel compares with each unit's breakpoint: 4 units compile faster than 32
    if fields.get("bias") == "fire":
        attn.bias_scheme.mlp = torch.nn.Sequential(
            torch.nn.Linear(1, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)
        )
    randomize(attn, seed, scale=0.3)
    if attn.config.bias == "fire":
        with torch.no_grad():
            attn.bias_scheme.threshold.fill_(4.0)  # queries on both sides of FIRE's threshold
    return attn


def run(fields, options, explicit_positions, seed=0, n_queries=LQ):
    """(compiled flex output, explicit path output) in fp32."""
    gen = torch.Generator().manual_seed(seed)
    x, mems = torch.randn(2, n_queries, 16, generator=gen), torch.randn(2, MEM, 16, generator=gen)
    padding = torch.zeros(2, MEM + n_queries, dtype=torch.bool)
    if options.get("padded"):
        padding[0, :2] = True
        padding[1, MEM + 1] = True
    call = AttentionOptions(
        key_padding_mask=padding if options.get("padded") else None,
        positions=drawn(MEM + n_queries, seed=seed) if explicit_positions else None,
        rope_scaling=options.get("rope_scaling"),
    )
    outs = []
    for backend in ("flex", "explicit"):
        attn = make(fields, seed, backend=backend)
        with torch.no_grad():
            outs.append(attn(x, mems, call)[0])
    return outs


def assert_close(fast, slow):
    torch.testing.assert_close(fast, slow, rtol=2e-5, atol=2e-6)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", CASES)
def test_compiled_flex_forward_equals_the_explicit_path(name, compiled):
    fields, options, explicit_positions = CASES[name]
    assert_close(*run(fields, options, explicit_positions))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_every_bias_type_shares_one_compiled_kernel(compiled):
    """Term b with each distance-only bias type read from its table: the same score_mod structure,
    so the learned ones share one compilation and the fixed ones (Sandwich: a curve that needs no
    gradient, which dynamo's guards tell apart) another; their tensors differ in values, not in
    shape or kind. A bias in closed form (ALiBi, KERPLE: BiasScheme.point_curve) is a structure of
    its own: at most one compilation each."""
    distance_only = [b for b in BIAS_TYPES if b not in ("none", "fire")]
    closed = {"alibi", "alibi_learned", "kerple_log", "kerple_power"}
    assert closed <= set(distance_only)
    for kind in (False, True):
        before = compiled()
        biases = [b for b in distance_only if (b in closed) == kind]
        for seed, bias in enumerate(biases):
            assert_close(
                *run(
                    dict(terms="abcd", window=4, sinks=2, bias=bias),
                    dict(padded=True),
                    False,
                    seed=seed,
                )
            )
        assert compiled() - before <= (len(biases) if kind else 2)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_new_length_compiles_once_and_a_repeated_one_not_at_all(compiled):
    """dynamic=False (flex.py): each new (L, M + L) compiles once; a length seen before reuses its
    kernel."""
    fields, options, _ = CASES["xl_window_sinks_padded"]
    assert_close(*run(fields, options, False))
    before = compiled()
    assert_close(*run(fields, options, False, seed=3, n_queries=LQ + 2))
    assert compiled() == before + 1
    assert_close(*run(fields, options, False, seed=4))
    assert_close(*run(fields, options, False, seed=5, n_queries=LQ + 2))
    assert compiled() == before + 1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_rope_rotates_q_and_k_before_the_kernel_and_compiles_nothing_new(compiled):
    """RoPE, xPos and YaRN change q and k, not the score_mod: on FoX's scores they reuse FoX's
    kernel."""
    assert_close(*run(*CASES["fox_log_n_tau_alibi"]))
    before = compiled()
    for name in ("rope_xpos", "rope_yarn"):
        assert_close(*run(*CASES[name], seed=1))
    assert compiled() == before


def graph_breaks(function, *args) -> list[str]:
    """Why torch.compile's graph breaks in function(*args), traced afresh ([]: one graph)."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(function)(*args)
    torch._dynamo.reset()
    return [
        f"{str(b.reason).splitlines()[0]} at {b.user_stack[-1]}" for b in explained.break_reasons
    ]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_building_the_call_breaks_no_graph():
    """Under torch.compile (train.compile) the call is built inside the compiled graph: a graph
    break there (a data-dependent index, a .item()) would cut every layer's forward on the GPU,
    where the call then goes to FlexAttention. FIRE is left out: whether its call is a curve
    reads its learned threshold (one .item(); on CUDA it trains on the block kernel). One trace
    builds every case's call."""
    distance_only = [b for b in BIAS_TYPES if b not in ("none", "fire")]
    cases = [dict(terms="a", bias=b) for b in distance_only]
    cases += [dict(terms="abcd"), dict(terms="a", forget_gate=True), dict(terms="a", sinks=2)]
    layers = [RelPosAttention(16, 2, 8, AttentionConfig(**fields)) for fields in cases]
    assert not graph_breaks(
        lambda x: [attn.kernel_call(x) for attn in layers], torch.randn(1, 12, 16)
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_forward_routed_as_on_cuda_is_one_graph(monkeypatch):
    """The attention's forward as CUDA runs it under train.compile (dispatch's CUDA rule, compiled
    FlexAttention) traces as one graph: no break from building the call, choosing the kernel or
    the block mask (functools.cached_property's lock once broke it on Python 3.11), nor from the
    compiled kernel first made inside the trace with Lightning imported (its wrapper of
    torch.compile once broke it at every FlexAttention call)."""
    import lightning.fabric  # noqa: F401  (replaces torch.compile, as in every training process)

    from relpos_ablate.model.kernels import dispatch

    on_cpu = dispatch.prefers_flex
    monkeypatch.setattr(dispatch, "prefers_flex", lambda *args: on_cpu(*args[:-1], True))
    monkeypatch.setattr(flex, "compiles", lambda q: True)
    cases = [dict(terms="a", bias="t5", window=8, sinks=2), dict(terms="a", forget_gate=True)]
    layers = [RelPosAttention(16, 2, 16, AttentionConfig(**fields)) for fields in cases]
    flex._kernel.cache_clear()  # made inside the trace, as in a compiled training step
    with torch.no_grad():  # (CPU FlexAttention: forward only)
        broken = graph_breaks(lambda x: [attn(x)[0] for attn in layers], torch.randn(1, 32, 16))
    assert not broken
