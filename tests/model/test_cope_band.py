"""CoPE on the band kernel (kernels/band.py, cope.band_width): once a query's count has passed
p_max - 1, every key further back scores s·q_i·e[p_max - 1], one constant per query, so those pairs
ride on the causal flash kernel and CoPE's scores, minus that constant, are built within the band D
only. D is read from the data.

The reference is written out here in float64 with every score materialised: the gates σ(s·q·kᵀ) of
the visible keys, each key's count as the sum of the gates from it to the query, clamped at p_max -
1, e interpolated between ⌊p⌋ and ⌈p⌉, s·q·e[p] added to s·q·kᵀ, masked causally, softmax, times v,
through W_o; its gradients by float64 autograd."""

import math

import pytest
import torch

from fixtures.attention import RTOL, forward_backward, relative_error
from fixtures.kernels import assert_candidates_agree, assert_matches_float64, forced_calibration
from fixtures.reference import reference_attention
from relpos_ablate import AttentionConfig, ConfigError, RelPosAttention
from relpos_ablate.model.core.options import AttentionOptions
from relpos_ablate.model.kernels import band, dispatch
from relpos_ablate.model.schemes.cope import BAND_CHUNK, COUNT_MARGIN


def _layer(
    backend: str = "band",
    positions: int = 8,
    heads: int = 2,
    d_head: int = 16,
    scale: float = 0.3,
    dtype=torch.float32,
    **config,
) -> RelPosAttention:
    torch.manual_seed(0)
    config = {"terms": "a", **config}
    attn = RelPosAttention(
        heads * d_head,
        heads,
        d_head,
        AttentionConfig(cope_positions=positions, backend=backend, **config),
    )
    with torch.no_grad():  # e away from its zero init, so that the positions move the softmax
        for p in attn.parameters():
            p.normal_(0, scale)
    return attn.to(dtype)


def _reference(
    attn: RelPosAttention, x: torch.Tensor, mems: torch.Tensor | None
) -> tuple[torch.Tensor, dict]:
    """(out, the float64 parameters it was computed from), every score materialised (module
    docstring)."""
    params = {name: p.detach().double().requires_grad_() for name, p in attn.named_parameters()}
    h, dh = attn.n_heads, attn.d_head
    x = x.double()
    cat = x if mems is None else torch.cat([mems.double(), x], dim=1)
    b, lq, n_keys = x.shape[0], x.shape[1], cat.shape[1]
    q = (x @ params["q_net.weight"].T).view(b, lq, h, dh).transpose(1, 2)
    k, v = (cat @ params["kv_net.weight"].T).view(b, n_keys, 2, h, dh).permute(2, 0, 3, 1, 4)
    s = 1 / math.sqrt(dh)
    visible = ((n_keys - lq + torch.arange(lq))[:, None] - torch.arange(n_keys)[None, :]) >= 0
    logits = s * q @ k.transpose(-1, -2)
    gates = torch.sigmoid(logits) * visible
    table = params["contextual.embeddings"]
    p = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=table.shape[0] - 1)  # Σ_{t >= j} g_it
    per_position = s * q @ table.T  # s·q_i·e[n]
    weight = p - p.floor()
    cope = (
        per_position.gather(-1, p.floor().long()) * (1 - weight)
        + per_position.gather(-1, p.ceil().long()) * weight
    )
    probs = (logits + cope).masked_fill(~visible, float("-inf")).softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(b, lq, h * dh) @ params["out_net.weight"].T
    return out, params


def _counted_reference(q: torch.Tensor, k: torch.Tensor, n_mem: int, scale: float) -> torch.Tensor:
    """Each visible key's count Σ_{t >= j} σ(s·q_i·k_t) in float64, NaN at hidden keys: [B, H, L,
    K]."""
    lq, n_keys = q.shape[2], k.shape[2]
    visible = ((n_mem + torch.arange(lq))[:, None] - torch.arange(n_keys)[None, :]) >= 0
    gates = torch.sigmoid(scale * q.double() @ k.double().transpose(-1, -2)) * visible
    return gates.flip(-1).cumsum(-1).flip(-1).masked_fill(~visible, float("nan"))


def test_the_band_is_the_farthest_key_a_count_is_near_p_max_minus_one_at():
    """band_width against the counts in float64: every key at distance D or more has a count above
    p_max - 1 (by the margin), and D is at most one chunk wider than the counts need (the farthest
    key whose count is at most p_max - 1 + the margin, plus 1), with blocks of the default 2·p_max
    queries and others."""
    gen = torch.Generator().manual_seed(0)
    n_mem, lq, positions = 40, 600, 16
    q, k = torch.randn(2, 3, lq, 8, generator=gen), torch.randn(2, 3, n_mem + lq, 8, generator=gen)
    attn = _layer(positions=positions, heads=3, d_head=8)
    counted = _counted_reference(q, k, n_mem, 0.5)
    distance = ((n_mem + torch.arange(lq))[:, None] - torch.arange(n_mem + lq)[None, :]).expand_as(
        counted
    )
    needed = int(distance[counted <= positions - 1 + COUNT_MARGIN].max()) + 1
    for rows in (None, 16, 48):
        width = attn.contextual.band_width(q, k, 0.5, n_mem, rows=rows)
        assert bool((counted[distance >= width] > positions - 1 + COUNT_MARGIN).all()), rows
        assert needed <= width < needed + BAND_CHUNK, rows
    assert 2 * positions <= needed < lq // 2  # the gates are about 1/2: about 2·p_max keys


def test_a_query_whose_count_never_passes_p_max_minus_one_puts_its_row_in_the_band():
    """Gates near 0 for one query: its count stays below p_max - 1 over its whole row, so the band
    covers that row (D beyond its key index); fewer than 2·p_max keys give no band at all."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 300, 4, generator=gen), torch.randn(1, 1, 300, 4, generator=gen)
    k[..., 0] = 1.0
    q[:, :, 250, :] = 0.0
    q[:, :, 250, 0] = -50.0  # σ(-50·s) ~ 0 at every key
    attn = _layer(positions=8, heads=1, d_head=4)
    assert attn.contextual.band_width(q, k, 0.5, 0) > 250
    assert attn.contextual.band_width(q[:, :, :15], k[:, :, :15], 0.5, 0) is None  # 15 keys < 2·8


def test_the_band_equals_the_float64_reference_at_4096_with_memory(monkeypatch):
    """fp32 on the band kernel vs float64, L = 4096 after 256 memory keys, p_max 16, one head (the
    small shapes below have two): the output within 1e-5, every parameter's gradient within 1e-5 of
    its largest entry."""
    attn = _layer(positions=16, heads=1, d_head=16, scale=0.2)
    gen = torch.Generator().manual_seed(1)
    x, mems = torch.randn(1, 4096, 16, generator=gen), torch.randn(1, 256, 16, generator=gen)
    widths = _recorded_bands(monkeypatch)
    out, _ = attn(x, mems)
    # the band ran, and its pairs are a small part of the 4352 keys
    assert len(widths) == 1 and widths[0] < 200
    ref, params = _reference(attn, x, mems)
    assert_matches_float64(attn, out, ref, params, gen, 1e-5, lambda name: 1e-5)


def _recorded_bands(monkeypatch) -> list[int]:
    """The band of every call band.banded makes from now on."""
    widths, real = [], band.banded
    monkeypatch.setattr(
        band, "banded", lambda call: (widths.append(call.saturation), real(call))[1]
    )
    return widths


@pytest.mark.parametrize("query_chunk", [0, 7, 32])
@pytest.mark.parametrize("n_mem,n_queries", [(0, 90), (5, 90), (70, 40), (200, 3)])
def test_the_band_equals_the_explicit_path_in_float64(query_chunk, n_mem, n_queries, monkeypatch):
    """One block, short blocks, a band that starts in the memory or covers it, a few queries after a
    long memory: output and every gradient equal the explicit path's (itself held to
    tests/fixtures/reference.py elsewhere) to 1e-12 in float64."""
    results = []
    widths = _recorded_bands(monkeypatch)
    for backend in ("band", "explicit"):
        attn = _layer(
            backend, positions=4, heads=2, d_head=8, dtype=torch.float64, query_chunk=query_chunk
        )
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(2, n_queries, 16, generator=gen, dtype=torch.float64, requires_grad=True)
        mems = torch.randn(2, n_mem, 16, generator=gen, dtype=torch.float64) if n_mem else None
        out, _ = attn(x, mems)
        out.square().sum().backward()
        results.append([out, x.grad, *(p.grad for p in attn.parameters())])
    assert len(widths) == 1 and 2 * widths[0] <= n_mem + n_queries  # the band ran, once
    for a, b in zip(*results):
        assert (a - b).abs().max() <= 1e-12 * max(1.0, float(b.detach().abs().max()))


def test_the_band_equals_the_pair_by_pair_reference():
    """The band kernel's forward (fp32) against tests/fixtures/reference.py's CoPE written pair by
    pair, after memory."""
    attn = _layer(positions=4, heads=2, d_head=8, query_chunk=16)
    gen = torch.Generator().manual_seed(3)
    x, mems = torch.randn(2, 40, 16, generator=gen), torch.randn(2, 12, 16, generator=gen)
    out, _ = attn(x, mems)
    pairwise, _ = reference_attention(attn, x, mems)
    assert (out.double() - pairwise).abs().max() <= 1e-5 * pairwise.abs().max()


def test_every_calibration_candidate_agrees_with_the_band():
    """band, blocks and sdpa (per query block) compute the same forward and gradients of a CoPE
    layer (fp32): within 2e-5 of the largest entry."""
    assert_candidates_agree(
        lambda backend: _layer(backend, positions=4, query_chunk=32),
        ("band", "blocks", "sdpa"),
        lambda tensor: 2e-5,
        "cope",
    )


@pytest.mark.parametrize("fastest", ["band", "blocks"])
def test_forced_timings_pick_each_path_of_a_cope_call(fastest, tmp_path, monkeypatch):
    """Through the model, with forced timings: each of band and blocks is chosen for a CoPE call and
    run."""
    cal = forced_calibration(monkeypatch, tmp_path, fastest)
    ran = []
    real_banded, real_blockwise = band.banded, dispatch._blockwise
    monkeypatch.setattr(band, "banded", lambda call: (ran.append("band"), real_banded(call))[1])
    monkeypatch.setattr(
        dispatch,
        "_blockwise",
        lambda call, *a: (
            ran.append("blocks") if call.far_from is None else None,
            real_blockwise(call, *a),
        )[1],
    )
    attn = _layer("auto", positions=4)
    out, _ = attn(torch.randn(1, 64, 32))
    out.sum().backward()
    assert cal.measured == 2 and sorted(set(ran[:-1])) == ["band", "blocks"] and ran[-1] == fastest


def test_only_cope_alone_on_plain_causal_attention_takes_the_band():
    """With a bias, term b, FoX, sinks, a window or key padding the call goes elsewhere; backend
    'band' is a config error there (CoPE itself is causal only)."""
    x = torch.randn(1, 64, 32)
    attn = _layer("auto", positions=4)
    call, q, _ = attn.kernel_call(x)
    assert band.with_term_band(call, q, torch.randn(1, 2, 64, 16), 0.0).saturation is not None
    for options in (
        AttentionOptions(window=30),
        AttentionOptions(key_padding_mask=torch.zeros(1, 64, dtype=torch.bool)),
    ):
        call, q, _ = attn.kernel_call(x, None, options)
        assert band.with_term_band(call, q, torch.randn(1, 2, 64, 16), 0.0).saturation is None, (
            options
        )
    for other in (dict(bias="alibi"), dict(forget_gate=True), dict(sinks=2), dict(terms="ab")):
        layer = _layer("auto", positions=4, **other)
        call, q, _ = layer.kernel_call(x)
        assert band.with_term_band(call, q, torch.randn(1, 2, 64, 16), 0.0).saturation is None, (
            other
        )
        with pytest.raises(ConfigError, match="backend"):
            AttentionConfig(
                terms=other.get("terms", "a"),
                cope_positions=4,
                backend="band",
                **{key: value for key, value in other.items() if key != "terms"},
            )
    # term c folds into the content query
    AttentionConfig(terms="ac", cope_positions=4, backend="band")


def test_the_band_under_bf16_autocast_matches_float32(monkeypatch):
    """Under torch.autocast("cpu", bf16) the band (its gates counted from the widened fp32 queries
    and keys, as the block kernel counts them) gives the fp32 output and gradients within
    test_attention_precision's 2.5% of their norm."""
    attn = _layer("auto", positions=4, query_chunk=16)
    gen = torch.Generator().manual_seed(5)
    x, mems = torch.randn(2, 70, 32, generator=gen), torch.randn(2, 10, 32, generator=gen)
    widths = _recorded_bands(monkeypatch)
    out32, grads32 = forward_backward(attn, x, mems, autocast=False)
    out16, grads16 = forward_backward(attn, x, mems, autocast=True)
    assert len(widths) == 2  # the band ran both times
    assert relative_error([out16], [out32]) < RTOL
    assert relative_error(grads16, grads32) < RTOL
