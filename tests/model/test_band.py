"""The band kernel (kernels/band.py): a map constant from a distance D on (a clamp of R, xl_table's
end, T5's last bucket) as its band on the block kernel plus the pairs beyond D on the causal flash
kernel.

The reference is written out here in float64 with every score materialised: each per-distance value
computed at its distance (R_d as the sinusoid or the learned table's row, T5's bucket by
tests/fixtures/reference.py's HF formula), indexed by i' - j, masked causally, softmax, times v,
through W_o; its gradients by float64 autograd."""

import pytest
import torch

from fixtures.attention import RTOL, forward_backward, randomize, relative_error
from fixtures.kernels import (
    assert_candidates_agree,
    assert_matches_float64,
    band_layer,
    band_reference,
    forced_calibration,
)
from fixtures.reference import reference_attention, t5_bucket_hf
from relpos_ablate import AttentionConfig, ConfigError
from relpos_ablate.model.core.options import AttentionOptions
from relpos_ablate.model.kernels import band, dispatch

BANDED = {
    "shaw": dict(terms="ab", rel="learned", clamp_len=5),
    "xl_clamped": dict(terms="abcd", clamp_len=6),
    "xl_table": dict(terms="a", bias="xl_table", max_distance=7),
    "t5": dict(terms="a", bias="t5", num_buckets=8, max_distance=12),
    "xl_d_and_t5": dict(terms="ad", clamp_len=6, bias="t5", num_buckets=8, max_distance=12),
}


# term b's clamped keys; a bias curve's last bucket
@pytest.mark.parametrize("name", ["shaw", "t5"])
def test_band_equals_the_float64_reference_at_4096_with_memory(name):
    """fp32 on the band kernel vs float64, L = 4096 after 256 memory keys: the output within 1e-5,
    every parameter's gradient within 1e-5 of its largest entry."""
    fields = {
        "shaw": dict(terms="ab", rel="learned", clamp_len=20),
        "t5": dict(terms="a", bias="t5"),
    }[name]
    attn = band_layer(fields, heads=2, d_head=16)
    with torch.no_grad():
        for p in attn.parameters():
            p.mul_(0.5)
    gen = torch.Generator().manual_seed(1)
    x, mems = torch.randn(1, 4096, 32, generator=gen), torch.randn(1, 256, 32, generator=gen)
    call, q, _ = attn.kernel_call(x, mems)
    assert dispatch.candidates(call, q, attn.config, 0.0) == ["band"]
    out, _ = attn(x, mems)
    ref, params = band_reference(attn, x, mems)
    assert_matches_float64(attn, out, ref, params, gen, 1e-5, lambda name: 1e-5)


@pytest.mark.parametrize("n_mem", [0, 3, 10, 40])
@pytest.mark.parametrize("name", list(BANDED))
def test_band_equals_the_references(name, n_mem):
    """Small shapes, blocks of 16 queries (a short last block): the forward against
    tests/fixtures/reference.py's pair-by-pair formula, and forward and every gradient against this
    file's float64 reference (within 1e-5 of the largest entry). Memory shorter and longer than the
    saturation distance gives both layouts of the far pairs (band.far_parts)."""
    attn = band_layer(BANDED[name], query_chunk=16)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 70, 32, generator=gen)
    mems = torch.randn(2, n_mem, 32, generator=gen) if n_mem else None
    call, q, _ = attn.kernel_call(x, mems)
    assert dispatch.candidates(call, q, attn.config, 0.0) == ["band"]
    out, _ = attn(x, mems)
    pairwise, _ = reference_attention(attn, x, mems)
    top = pairwise.abs().max()
    assert (out.double() - pairwise).abs().max() <= 1e-5 * top
    ref, params = band_reference(attn, x, mems)
    assert_matches_float64(attn, out, ref, params, gen, 1e-5 * top, lambda name: 1e-5)


@pytest.mark.parametrize("query_chunk", [0, 1, 7])
@pytest.mark.parametrize("n_mem,n_queries", [(0, 12), (30, 12), (12, 1), (9, 3)])
def test_band_edges_equal_the_explicit_path_in_float64(query_chunk, n_mem, n_queries):
    """One block (query_chunk 0), one query per block, a single query, memory longer than the
    segment: the band kernel's output and every gradient equal the explicit path's (itself held to
    tests/fixtures/reference.py elsewhere) to 1e-12 in float64."""
    for fields in (
        dict(terms="ab", rel="learned", clamp_len=4),
        dict(terms="a", bias="xl_table", max_distance=3),
    ):
        results = []
        for backend in ("band", "explicit"):
            attn = band_layer(
                fields,
                backend=backend,
                dtype=torch.float64,
                query_chunk=query_chunk,
                heads=2,
                d_head=8,
            )
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(
                2, n_queries, 16, generator=gen, dtype=torch.float64, requires_grad=True
            )
            mems = torch.randn(2, n_mem, 16, generator=gen, dtype=torch.float64) if n_mem else None
            if backend == "band":
                call, q, _ = attn.kernel_call(x, mems)
                assert dispatch.candidates(call, q, attn.config, 0.0) == ["band"]
            out, _ = attn(x, mems)
            out.square().sum().backward()
            results.append([out, x.grad, *(p.grad for p in attn.parameters())])
        for a, b in zip(*results):
            assert (a - b).abs().max() <= 1e-12 * max(1.0, float(b.detach().abs().max())), fields


def test_far_parts_cover_the_far_pairs_once():
    """The flash-kernel calls of band.far_parts, with the band (window D), see every causal pair
    exactly once."""
    for n_mem, lq, d in ((0, 20, 5), (3, 20, 5), (5, 20, 5), (12, 20, 5), (0, 5, 5), (2, 4, 9)):
        attn = band_layer(
            dict(terms="a", bias="xl_table", max_distance=d)
        )  # saturation = max_distance
        call, _, _ = attn.kernel_call(
            torch.randn(1, lq, 32), torch.randn(1, n_mem, 32) if n_mem else None
        )
        far = band.banded(call) if call.n_keys > d else None  # (no key at distance d: no far pairs)
        seen = torch.zeros(lq, n_mem + lq, dtype=torch.int64)
        if far is not None:
            for part in band.far_parts(far):
                rows = torch.arange(part.rows.start, part.rows.stop)[:, None]
                keys = torch.arange(part.keys.start, part.keys.stop)[None, :]
                covered = (
                    (keys - part.keys.start <= rows - part.rows.start)
                    if part.causal
                    else torch.ones_like(rows * keys, dtype=torch.bool)
                )
                seen[part.rows, part.keys] += covered.long()
        distance = (n_mem + torch.arange(lq))[:, None] - torch.arange(n_mem + lq)[None, :]
        seen += ((distance >= 0) & (distance < d)).long()  # the band
        assert torch.equal(seen, (distance >= 0).long()), (n_mem, lq, d)


def test_saturation_of_each_scheme():
    """The distance from which each per-distance input is constant: clamp_len for R, max_distance
    for xl_table, T5's last bucket's first distance (by the HF formula); none for unclamped R or a
    bias that keeps changing."""
    x = torch.randn(1, 300, 32)
    expected = {"shaw": 5, "xl_clamped": 6, "xl_table": 7}
    first_far = next(d for d in range(200) if t5_bucket_hf(-d, False, 8, 12) == 7)
    for name, fields in BANDED.items():
        call, _, _ = band_layer(fields).kernel_call(x)
        assert call.saturation == expected.get(
            name, max(6, first_far) if "xl" in name else first_far
        ), name
    for fields in (
        dict(terms="ab"),
        dict(terms="a", bias="kerple_log"),
        dict(terms="a", bias="alibi"),
        dict(terms="ab", clamp_len=4, bias="kerple_log"),
        dict(terms="a", bias="fire"),
    ):
        call, _, _ = band_layer(fields, backend="auto").kernel_call(x)
        assert call.saturation is None, fields


def test_the_band_only_takes_calls_it_can():
    """A window, key padding, explicit positions, sinks, a query scale or too few keys send the call
    elsewhere; a pinned band on such a call goes to the block kernel; a config the band can never
    take is a one-line error."""
    attn = band_layer(BANDED["t5"], backend="auto")
    x = torch.randn(1, 40, 32)
    call, q, _ = attn.kernel_call(x)
    assert dispatch.candidates(call, q, attn.config, 0.0)[0] == "band"
    for options in (
        AttentionOptions(window=8),
        AttentionOptions(positions=torch.arange(40) * 2),
        AttentionOptions(key_padding_mask=torch.zeros(1, 40, dtype=torch.bool)),
    ):
        call, q, _ = attn.kernel_call(x, None, options)
        assert "band" not in dispatch.candidates(call, q, attn.config, 0.0), options
    call, q, _ = attn.kernel_call(x[:, :19])  # 19 keys < twice the saturation distance (10)
    assert "band" not in dispatch.candidates(call, q, attn.config, 0.0)
    for other in (
        dict(sinks=2),
        dict(score_scale="log_n", log_n_length=8),
        dict(learned_temperature=True),
    ):
        layer = band_layer({**BANDED["t5"], **other}, backend="auto")
        call, q, _ = layer.kernel_call(x)
        assert "band" not in dispatch.candidates(call, q, layer.config, 0.0), other
    pinned = band_layer(BANDED["t5"], backend="band")
    call, q, _ = pinned.kernel_call(x, None, AttentionOptions(window=8))
    assert dispatch.candidates(call, q, pinned.config, 0.0) == ["blocks"]
    with pytest.raises(ConfigError, match="backend.*'band' takes causal attention"):
        AttentionConfig(terms="ab", backend="band")  # R without a clamp never saturates


def test_every_calibration_candidate_agrees_with_the_band():
    """band, blocks and sdpa (per query block) compute the same forward and gradients (fp32): within
    2e-5 of the largest entry, 1e-4 for a bias table's gradient."""

    # a bias table's gradient sums dS over many pairs that cancel (rows sum to 0)
    def limit(tensor: str) -> float:
        return 1e-4 if tensor.endswith("table") else 2e-5

    for name, fields in BANDED.items():
        assert_candidates_agree(
            lambda backend, fields=fields: band_layer(fields, backend=backend, query_chunk=32),
            ("band", "blocks", "sdpa"),
            limit,
            name,
        )


@pytest.mark.parametrize("name", list(BANDED))
def test_band_under_bf16_autocast_matches_float32(name):
    """Under torch.autocast("cpu", bf16) the band kernel (both its parts in fp32, as the block
    kernel widens them) gives the fp32 output and gradients within test_attention_precision's 2.5%
    of their norm."""
    attn = band_layer(BANDED[name], query_chunk=16)
    randomize(attn, 0, scale=0.2)
    gen = torch.Generator().manual_seed(5)
    x, mems = torch.randn(2, 70, 32, generator=gen), torch.randn(2, 10, 32, generator=gen)
    with torch.autocast("cpu", torch.bfloat16):
        call, q, _ = attn.kernel_call(x, mems)
        assert call.dtype == torch.bfloat16 and dispatch.candidates(call, q, attn.config, 0.0) == [
            "band"
        ]
    out32, grads32 = forward_backward(attn, x, mems, autocast=False)
    out16, grads16 = forward_backward(attn, x, mems, autocast=True)
    assert relative_error([out16], [out32]) < RTOL
    assert relative_error(grads16, grads32) < RTOL


@pytest.mark.parametrize("fastest", ["band", "blocks", "sdpa"])
def test_forced_timings_pick_each_path_of_a_banded_call(fastest, tmp_path, monkeypatch):
    """Through the model: with forced timings each candidate is chosen and run."""
    cal = forced_calibration(monkeypatch, tmp_path, fastest)
    ran = []
    real_banded, real_stored, real_blockwise = band.banded, dispatch._stored, dispatch._blockwise
    monkeypatch.setattr(band, "banded", lambda call: (ran.append("band"), real_banded(call))[1])
    monkeypatch.setattr(dispatch, "_stored", lambda *a: (ran.append("sdpa"), real_stored(*a))[1])
    monkeypatch.setattr(
        dispatch,
        "_blockwise",
        lambda call, *a: (
            ran.append("blocks") if call.far_from is None else None,
            real_blockwise(call, *a),
        )[1],
    )
    attn = band_layer(BANDED["shaw"], backend="auto", max_stored_scores_mb=64)
    out, _ = attn(torch.randn(1, 64, 32))
    out.sum().backward()
    assert (
        cal.measured == 3
        and sorted(set(ran[:-1])) == ["band", "blocks", "sdpa"]
        and ran[-1] == fastest
    )
