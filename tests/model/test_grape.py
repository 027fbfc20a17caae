"""GRAPE's score terms (relpos_ablate/model/schemes/grape.py): each block map against the float64
loops of tests/fixtures/reference_grape.py (Eq. 4.6, Eq. 5.1-5.2) with memory, key padding,
explicit positions, later query blocks, windowed blocks and backward's key tiles; their special
cases to rounding in float64 (GRAPE-A without gates = ALiBi, the path sum of FoX's gates = FoX, of
constant edges = ALiBi); every parameter's gradient by gradcheck; the kernels that take them
(SDPA per block; GRAPE-AP also the block kernel and FlexAttention) against the dense map.
Run: pytest tests/model/test_grape.py -q"""

import math
from types import SimpleNamespace

import pytest
import torch

from fixtures import reference_grape
from fixtures.reference import TermInputs
from relpos_ablate import planner
from relpos_ablate.model.core.call import AttentionCall
from relpos_ablate.model.core.geometry import Visibility
from relpos_ablate.model.core.placement import place
from relpos_ablate.model.kernels import dispatch
from relpos_ablate.model.schemes.alibi import ALiBiBias, alibi_slopes
from relpos_ablate.model.schemes.fox import ForgetGate
from relpos_ablate.model.schemes.grape import GrapeA, GrapeAP, path_sum

D_MODEL, HEADS, D_HEAD, D_PROBE = 6, 3, 4, 4
F64 = torch.float64


def config(**fields):
    return SimpleNamespace(
        **{"grape": "a", "grape_gates": "qk", "grape_ap_dim": D_PROBE, "causal": True, **fields}
    )


def grape_a(gates="qk", heads=HEADS, seed=0):
    """GRAPE-A in float64 with ω̃ drawn around its init (u, v drawn at build)."""
    torch.manual_seed(seed)
    scheme = GrapeA.build(D_MODEL, heads, D_HEAD, config(grape_gates=gates)).double()
    with torch.no_grad():
        scheme.omega_raw.add_(0.5 * torch.randn(heads, dtype=F64))
    return scheme


def grape_ap(heads=HEADS, seed=0, scale=2.0):
    """GRAPE-AP in float64 with W_p widened (scale): edges spread over log σ's curve."""
    torch.manual_seed(seed)
    scheme = GrapeAP.build(D_MODEL, heads, D_HEAD, config(grape="ap")).double()
    with torch.no_grad():
        scheme.probe_weight.mul_(scale)
    return scheme


def make_call(n_mem, lq, positions=None, padding=None, window=None, terms=(), query_chunk=0):
    visibility = Visibility(n_mem, True, window)
    placement = place(visibility, lq, positions, "cpu")._replace(key_padding_mask=padding)
    return AttentionCall(
        visibility, lq, placement, D_HEAD**-0.5, F64, terms=terms, query_chunk=query_chunk
    )


def data(n_mem, lq, batch=2, heads=HEADS, seed=1):
    """(keys' layer inputs [B, K, d_model], q [B, H, L, dh], k [B, H, K, dh]) in float64."""
    gen = torch.Generator().manual_seed(seed)
    cat = torch.randn(batch, n_mem + lq, D_MODEL, generator=gen, dtype=F64)
    q = 2 * torch.randn(batch, heads, lq, D_HEAD, generator=gen, dtype=F64)
    k = 2 * torch.randn(batch, heads, n_mem + lq, D_HEAD, generator=gen, dtype=F64)
    return cat, q, k


def reference(formula, scheme, call, cat, q, k, gates="qk"):
    """The whole call's map [B, H, L, K] by reference_grape's loops."""
    visible = call.visible(call.all_queries)
    visible = visible if visible.dim() == 4 else visible[None, None]
    inputs = TermInputs(
        scheme=scheme,
        cat=cat,
        padding=call.key_padding_mask,
        n_mem=call.n_mem,
        positions=call.key_positions.tolist(),
        k=k.transpose(1, 2),
        q_content=q,
        visible=visible.expand(q.shape[0], 1, -1, -1),
        scale=call.scale,
        temperature=torch.ones(*q.shape[:3], 1, dtype=F64),
    )
    attn = SimpleNamespace(config=config(grape_gates=gates))
    return formula(attn, inputs)


def blocks_of(call):
    """The whole call, a later block, a windowed block (k0 > 0) and backward's key tiles of a later
    block (the first tile's keys stop before the block's queries)."""
    later = call.block(3, call.n_queries)
    windowed = call._block(3, call.n_queries, 2, later.n_keys)
    return [call.all_queries, later, windowed, *call.key_tiles(later, 4)]


CONDITIONS = {
    "nomem": dict(n_mem=0),
    "mem": dict(n_mem=3),
    "padding": dict(n_mem=3, padding=True),
    "positions": dict(n_mem=3, positions=True),
}


def conditioned(n_mem, padding=False, positions=False, lq=6, batch=2):
    n_keys = n_mem + lq
    pad = None
    if padding:
        pad = torch.zeros(batch, n_keys, dtype=torch.bool)
        pad[0, :2] = True
        pad[1, n_mem + 2] = True
    where = torch.tensor([0, 1, 3, 4, 7, 8, 9, 12, 13][:n_keys]) * 2 if positions else None
    return make_call(n_mem, lq, positions=where, padding=pad)


@pytest.mark.parametrize("condition", CONDITIONS)
@pytest.mark.parametrize("gates", ["qk", "q", "k", "none"])
def test_grape_a_block_is_eq_4_6(gates, condition):
    scheme = grape_a(gates)
    call = conditioned(**CONDITIONS[condition])
    cat, q, k = data(call.n_mem, call.n_queries)
    want = reference(reference_grape.grape_a, scheme, call, cat, q, k, gates)
    term = scheme.term(cat, call.key_padding_mask)
    for blk in blocks_of(call):
        keys = slice(blk.k0, blk.n_keys)
        got = term.block(call, blk, q[:, :, blk.rows], k[:, :, keys])
        visible = call.visible(blk)  # (explicit positions: hidden pairs' distances are clamped)
        expected = want[:, :, blk.rows, keys].masked_fill(~visible, 0.0)
        torch.testing.assert_close(
            got.expand_as(expected).masked_fill(~visible, 0.0), expected, rtol=1e-12, atol=1e-12
        )


@pytest.mark.parametrize("condition", CONDITIONS)
def test_grape_ap_block_is_eq_5_1_and_5_2(condition):
    scheme = grape_ap()
    call = conditioned(**CONDITIONS[condition])
    cat, q, k = data(call.n_mem, call.n_queries)
    want = reference(reference_grape.grape_ap, scheme, call, cat, q, k)
    assert want.abs().max() > 0.1  # edges summed over several keys
    term = scheme.term(cat, call.key_padding_mask)
    for blk in blocks_of(call):
        got = term.block(call, blk)
        torch.testing.assert_close(
            got, want[:, :, blk.rows, blk.k0 : blk.n_keys], rtol=1e-12, atol=1e-12
        )


def test_grape_ap_reads_the_raw_query_probe_and_the_turned_normalised_key_probe():
    """Turning the key probes by another angle, or normalising the query's, changes the map: the
    reference's conventions are the scheme's, not a symmetric form both would share."""
    scheme = grape_ap()
    call = conditioned(n_mem=3)
    cat, q, k = data(3, 6)
    base = scheme.term(cat, None).block(call, call.all_queries)
    moved = make_call(3, 6, positions=torch.arange(9) + 1)  # every angle + 1 radian
    assert (scheme.term(cat, None).block(moved, moved.all_queries) - base).abs().max() > 1e-3
    with torch.no_grad():
        scheme.probe_weight.mul_(3.0)  # p̂ unchanged, the raw query probe 3x
    assert (scheme.term(cat, None).block(call, call.all_queries) - base).abs().max() > 1e-3


@pytest.mark.parametrize("heads", [4, 6])
@pytest.mark.parametrize("positions", [False, True])
def test_grape_a_without_gates_at_init_is_alibi(heads, positions):
    """(a): gates none, ω̃ at softplus⁻¹(1): B = -β_h·|i - j|, ALiBiBias's map, to rounding."""
    scheme = GrapeA.build(D_MODEL, heads, D_HEAD, config(grape_gates="none")).double()
    with torch.no_grad():  # its init in float64 (the float32 parameter rounds softplus⁻¹(1))
        scheme.omega_raw.fill_(math.log(math.expm1(1.0)))
    alibi = ALiBiBias(heads, SimpleNamespace(causal=True)).double()
    call = conditioned(n_mem=3, positions=positions)
    _, q, k = data(3, 6, heads=heads)
    got = scheme.term(None, None).block(call, call.all_queries, q, k)[0]
    want = alibi.bias(call.query_positions, call.key_positions)  # (H, L, K)
    visible = call.visible(call.all_queries)
    torch.testing.assert_close(
        got.masked_fill(~visible, 0.0), want.masked_fill(~visible, 0.0), rtol=1e-15, atol=1e-15
    )


@pytest.mark.parametrize("padding", [False, True])
def test_path_sum_of_fox_gates_is_fox(padding):
    """(b): endpoint-independent edges e(t, ℓ) = log σ(w·x_ℓ + b) give ForgetTerm.block."""
    torch.manual_seed(2)
    gate = ForgetGate(D_MODEL, HEADS).double()
    with torch.no_grad():
        gate.proj.weight.normal_(0, 1.0)
        gate.proj.bias.normal_(0, 1.0)
    call = conditioned(n_mem=3, padding=padding)
    cat, _, _ = data(3, 6)
    fox = gate.term(cat, call.key_padding_mask)
    log_gates = gate.log_gates(cat, call.key_padding_mask)  # (B, H, K)
    for blk in blocks_of(call)[:3]:
        keys = torch.arange(blk.k0, blk.n_keys)
        edges = log_gates[:, :, None, blk.k0 : blk.n_keys]  # (B, H, 1, K_b): no query endpoint
        queries = torch.arange(call.n_mem + blk.i0, call.n_mem + blk.i1)
        got = path_sum(edges.expand(-1, -1, len(queries), -1), queries, keys)
        visible = call.visible(blk)
        torch.testing.assert_close(
            got.masked_fill(~visible, 0.0),
            fox.block(call, blk).masked_fill(~visible, 0.0),
            rtol=1e-14,
            atol=1e-14,
        )


@pytest.mark.parametrize("heads", [4, 6])
def test_path_sum_of_constant_edges_is_alibi(heads):
    """(c): e(t, ℓ) = -β_h gives -β_h·(i' - j)."""
    call = conditioned(n_mem=3)
    alibi = ALiBiBias(heads, SimpleNamespace(causal=True)).double()
    beta = torch.tensor(alibi_slopes(heads), dtype=torch.float32).double()
    n_keys, lq = call.n_keys, call.n_queries
    edges = -beta[None, :, None, None].expand(1, heads, lq, n_keys)
    got = path_sum(edges, torch.arange(call.n_mem, n_keys), torch.arange(n_keys))[0]
    want = alibi.bias(call.query_positions, call.key_positions)
    visible = call.visible(call.all_queries)
    torch.testing.assert_close(
        got.masked_fill(~visible, 0.0), want.masked_fill(~visible, 0.0), rtol=1e-15, atol=1e-15
    )


@pytest.mark.parametrize("gates", ["qk", "q", "k", "none"])
def test_grape_a_gradients_by_gradcheck(gates):
    scheme = grape_a(gates, heads=2)
    call = conditioned(n_mem=1, positions=True, lq=3, batch=1)
    _, q, k = data(1, 3, batch=1, heads=2)
    q, k = q.requires_grad_(), k.requires_grad_()
    term = scheme.term(None, None)
    leaves = (*scheme.parameters(), q, k)
    assert len(leaves) == 3 + {"qk": 2, "q": 1, "k": 1, "none": 0}[gates]
    for blk in (call.all_queries, call.block(1, 3)):
        keys = slice(blk.k0, blk.n_keys)

        def block_map(*_, blk=blk, keys=keys):
            return term.block(call, blk, q[:, :, blk.rows], k[:, :, keys])

        assert torch.autograd.gradcheck(block_map, leaves)


def test_grape_ap_gradients_by_gradcheck():
    scheme = grape_ap(heads=2)
    call = conditioned(n_mem=1, padding=True, positions=True, lq=4, batch=2)
    cat = data(1, 4, batch=2, heads=2)[0].requires_grad_()
    later = call.block(2, 4)
    for blk in (call.all_queries, later, *call.key_tiles(later, 2)):

        def block_map(weight, x, blk=blk):
            return scheme.term(x, call.key_padding_mask).block(call, blk)

        assert torch.autograd.gradcheck(block_map, (scheme.probe_weight, cat))


def _kernel_case(term_of, scheme, n_mem, lq, backend, query_chunk, heads=HEADS):
    """The kernel's output and gradients (q, k, v, the scheme's parameters) against the dense map
    of the term's own block form under autograd, softmax in float64."""
    cat, q, k = data(n_mem, lq, batch=1, heads=heads, seed=5)
    v = torch.randn(1, heads, n_mem + lq, D_HEAD, dtype=F64, generator=torch.Generator())
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *scheme.parameters()]
    weights = torch.linspace(-1, 1, lq * heads * D_HEAD, dtype=F64).view(1, heads, lq, D_HEAD)

    def run(fast):
        call = make_call(n_mem, lq, terms=(term_of(cat),), query_chunk=query_chunk)
        if fast:
            choice = SimpleNamespace(backend=backend, max_stored_scores_mb=0.0)
            out = dispatch.attend(call, q, k, v, None, choice, 0.0)
        else:
            blk = call.all_queries
            scores = call.scale * q @ k.transpose(-1, -2) + call.terms[0].block(call, blk, q, k)
            scores = scores.masked_fill(~call.visible(blk), float("-inf"))
            out = scores.softmax(-1) @ v
        return out, torch.autograd.grad((out * weights).sum(), leaves)

    (out, grads), (want, want_grads) = run(True), run(False)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_grape_a_takes_sdpa_per_block_and_no_kernel_that_cannot_read_content():
    scheme = grape_a("qk")
    call = make_call(2, 8, terms=(scheme.term(None, None),))
    assert not planner.blocks(call.plan) and not planner.flex(call.plan)
    _kernel_case(lambda cat: scheme.term(cat, None), scheme, 4, 40, "sdpa", 16)


@pytest.mark.parametrize("backend", ["sdpa", "blocks"])
def test_grape_ap_on_the_kernels(backend):
    """300 queries: the block kernel's backward cuts a block's keys into tiles of 256 (its
    MATERIALISED_ROWS), the first ending before the block's later queries."""
    scheme = grape_ap(heads=2)
    call = make_call(4, 8, terms=(scheme.term(data(4, 8)[0], None),))
    assert planner.blocks(call.plan) and planner.flex(call.plan)
    _kernel_case(lambda cat: scheme.term(cat, None), scheme, 4, 300, backend, 64, heads=2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_grape_ap_on_flex_attention_reads_its_dense_map():
    scheme = grape_ap(heads=2)
    cat, q, k = data(3, 12, batch=1, heads=2)
    v = torch.randn_like(k)
    call = make_call(3, 12, terms=(scheme.term(cat, None),))
    with torch.no_grad():
        choice = SimpleNamespace(backend="flex", max_stored_scores_mb=0.0)
        out = dispatch.attend(call, q, k, v, None, choice, 0.0)
        blk = call.all_queries
        scores = call.scale * q @ k.transpose(-1, -2) + call.terms[0].block(call, blk)
        want = scores.masked_fill(~call.visible(blk), float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


def test_schemes_build_with_their_init_forms_and_names():
    a = GrapeA.build(32, 8, 16, config(grape_gates="qk"))
    assert a.attribute == "grape_a" and GrapeA.Term.forms == frozenset({"content"})
    assert set(a.state_dict()) == {"omega_raw", "query_gate_v", "key_gate_u"}
    torch.testing.assert_close(a.slope(torch.float32), torch.tensor(alibi_slopes(8)))  # ω = β
    assert set(GrapeA.build(32, 8, 16, config(grape_gates="k")).state_dict()) == {
        "omega_raw",
        "key_gate_u",
    }
    assert set(GrapeA.build(32, 8, 16, config(grape_gates="none")).state_dict()) == {"omega_raw"}
    ap = GrapeAP.build(256, 8, 16, config(grape="ap", grape_ap_dim=8))
    assert ap.attribute == "grape_ap" and GrapeAP.Term.forms == frozenset()
    assert ap.probe_weight.shape == (64, 256)
    assert abs(ap.probe_weight.std().item() - 0.5 / math.sqrt(256)) < 0.002
    term = ap.term(torch.randn(2, 5, 256), None)
    assert term.tensors[0].shape == (2, 8, 5, 8) and list(term.parameters()) == []
    with pytest.raises(ValueError, match="grape_gates: 'kq' is not one of qk, q, k, none"):
        GrapeA.build(32, 8, 16, config(grape_gates="kq"))
    with pytest.raises(ValueError, match="grape_ap_dim: 5 must be even"):
        GrapeAP.build(32, 8, 16, config(grape_ap_dim=5))
    with pytest.raises(ValueError, match="causal attention only"):
        GrapeAP.build(32, 8, 16, config(causal=False))
