"""The parity matrix, generated from the registry (relpos_ablate/config/registry/builtins.py): every
registered bias (on term a), Transformer-XL without one (terms 'abcd'; 'ab' with clamp_len), RoPE,
and every registered score-term scheme (on term a, NoPE) × every kernel the planner allows for that
config on CPU (explicit, sdpa, blocks, low_rank, band, flex) × a condition (no memory, memory, key
padding, a call's window, explicit positions). Each case's output equals the float64 reference
(tests/fixtures/reference.py: BIAS_FORMULAS, TERM_FORMULAS), and, on the kernels with a backward,
the gradient of the input and of every parameter equals autograd through the explicit scores in
float64 (FlexAttention: forward only on CPU, eager, under no_grad).

A new scheme gets every case by its registry line and one formula line in the reference. Where a
case does not exist, the code says so, not a list here: a kernel the config refuses (ConfigError,
or the planner's `blocks`/`flex` answer for the config), or a call the pinned kernel leaves to
another (dispatch.candidates: low_rank and band take plain causal calls only).
Run: pytest tests/model/test_parity_matrix.py -q -n 2
"""

import pytest
import torch

from fixtures.matrix import (
    D_HEAD,
    D_MODEL,
    HEADS,
    KERNELS,
    LQ,
    MEM,
    PINNED,
    SCHEMES,
    allowed,
    layer,
)
from fixtures.reference import BIAS_FORMULAS, TERM_FORMULAS, reference_attention
from fixtures.reference_parts import PART_SETTINGS
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.config import registry
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.kernels import dispatch

CONDITIONS = ("nomem", "mem", "padding", "window", "positions")


CASES = [
    (scheme, kernel, condition)
    for scheme, fields in SCHEMES.items()
    for kernel in KERNELS
    if allowed(fields, kernel)
    for condition in CONDITIONS
]


def _inputs(condition: str):
    """(x, mems, the call's options, the reference's keywords) of a condition: memory in every one
    but `nomem`; two padded keys in the first row (memory), one in the second (the segment)."""
    gen = torch.Generator().manual_seed(CONDITIONS.index(condition))
    x = torch.randn(2, LQ, D_MODEL, generator=gen, dtype=torch.float64)
    if condition == "nomem":
        return x, None, AttentionOptions(), {}
    mems = torch.randn(2, MEM, D_MODEL, generator=gen, dtype=torch.float64)
    kw = {}
    if condition == "padding":
        padding = torch.zeros(2, MEM + LQ, dtype=torch.bool)
        padding[0, :2] = True
        padding[1, MEM + 3] = True
        kw = dict(padding=padding)
    elif condition == "window":
        kw = dict(window=3)
    elif condition == "positions":
        kw = dict(positions=torch.arange(MEM + LQ) * 2)
    options = AttentionOptions(
        window=kw.get("window"),
        key_padding_mask=kw.get("padding"),
        positions=kw.get("positions"),
    )
    return x, mems, options, kw


def _gradients(attn, x, mems, options, explicit: bool):
    """(out, gradients of a fixed weighting of it w.r.t. x and every parameter)."""
    xx = x.clone().requires_grad_(True)
    out, _ = attn(xx, mems, options, need_weights=explicit)
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
    grads = torch.autograd.grad((out * weights).sum(), [xx, *attn.parameters()], allow_unused=True)
    return out, grads


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("scheme, kernel, condition", CASES, ids=["-".join(case) for case in CASES])
def test_kernel_matches_the_float64_reference(scheme, kernel, condition):
    attn = layer(scheme, kernel)
    x, mems, options, kw = _inputs(condition)
    if kernel in PINNED:
        call, q_content, _ = attn.kernel_call(x, mems, options)
        chosen = dispatch.candidates(call, q_content, attn.config, 0.0)
        if chosen != [kernel]:
            pytest.skip(f"{kernel} leaves this call to {chosen} (dispatch.candidates)")
    ref_out, ref_probs = reference_attention(attn, x, mems, **kw)
    if kernel == "explicit":
        out, probs = attn(x, mems, options, need_weights=True)
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-9)
        return
    if kernel == "flex":  # no backward on CPU
        with torch.no_grad():
            out, _ = attn(x, mems, options)
        torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-9)
        return
    out, fast = _gradients(attn, x, mems, options, explicit=False)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-9)
    _, slow = _gradients(attn, x, mems, options, explicit=True)
    names = ["x", *(name for name, _ in attn.named_parameters())]
    for name, f, s in zip(names, fast, slow):
        assert s is not None, f"{name} gets no gradient from the explicit scores"
        assert f is not None, f"{name} gets no gradient from {kernel}"
        torch.testing.assert_close(f, s, rtol=1e-7, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_the_matrix_covers_every_registered_scheme_with_its_formula():
    """Every registered bias and score-term scheme has its float64 formula in
    tests/fixtures/reference.py, and is in the matrix on the explicit kernel and on the block
    kernel."""
    assert set(BIAS_FORMULAS) == set(registry.bias_types()) - {"none"}, (
        "every registered bias needs one line in BIAS_FORMULAS of tests/fixtures/reference.py"
    )
    assert set(TERM_FORMULAS) == set(registry.term_schemes()), (
        "every registered term scheme needs one line in TERM_FORMULAS of "
        "tests/fixtures/reference.py"
    )
    assert set(PART_SETTINGS) >= set(registry.BUILTIN_PARTS) - {
        "sink_slots",
        "temperature_tuning",
    }, "every built-in part needs its settings in PART_SETTINGS (tests/fixtures/reference_parts.py)"
    covered = {(scheme, kernel) for scheme, kernel, _ in CASES}
    for name in [*BIAS_FORMULAS, *TERM_FORMULAS]:
        entry = registry.BUILTIN_TERMS.get(name)
        forms = set(entry.forms.split()) if entry else set()
        kernels = {"explicit", "sdpa"}
        if "content" not in forms or "hand" in forms:  # content without a hand form: off blocks
            kernels.add("blocks")
        assert {(name, k) for k in kernels} <= covered, name


def test_a_term_scheme_without_a_formula_names_the_missing_line(monkeypatch):
    from relpos_ablate.model import ScoreTerm, TermScheme

    monkeypatch.setattr(registry, "_registered_terms", {})

    @registry.register_term("unwritten")
    class Unwritten(TermScheme):
        Term = ScoreTerm

        def __init__(self, d_model, n_heads, d_head, config):
            super().__init__()

    attn = RelPosAttention(D_MODEL, HEADS, D_HEAD, AttentionConfig(term_schemes=("unwritten",)))
    with pytest.raises(KeyError, match="add one line 'unwritten': ... to TERM_FORMULAS"):
        reference_attention(attn.double(), *_inputs("nomem")[:2])
