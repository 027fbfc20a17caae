"""The block kernel (model/kernels/blockwise.py) and the layouts of its maps
(model/kernels/block_maps.py): the strided views equal the materialised map of every block, hold no
[L_b, K_b] tensor of their own, and the tensor-op forward used off CPU gives what the fused CPU
flash kernel gives, gradients included. Parity with the float64 reference on every scheme:
test_attention_reference.py, test_newer_schemes.py.
Run: pytest tests/model/test_block_kernel.py -q"""

import pytest
import torch

from fixtures.attention import fast_and_explicit_gradients, randomize
from relpos_ablate import AttentionConfig, RelPosAttention
from relpos_ablate.model import AttentionOptions
from relpos_ablate.model.kernels import block_maps as layouts
from relpos_ablate.model.kernels import blockwise as kernels
from relpos_ablate.model.kernels import materialised_maps
from relpos_ablate.model.kernels.block_maps import StridedMaps
from relpos_ablate.model.kernels.blockwise import block_maps
from relpos_ablate.model.kernels.materialised_maps import MaterialisedMaps

LAYOUTS = {  # fields -> the layout the call gets
    "t5": (dict(terms="a", bias="t5", num_buckets=8, max_distance=6), "hankel"),
    "term_d_window": (dict(terms="ad", window=4, bias="alibi"), "hankel"),
    "xl_abcd": (dict(terms="abcd"), "term_b"),
    "xl_kerple_bidir": (dict(terms="ab", bias="kerple_log", causal=False), "term_b"),
    "fox": (dict(terms="a", forget_gate=True), "materialised"),
    "sinks_t5": (
        dict(terms="a", bias="t5", sinks=2, num_buckets=8, max_distance=6),
        "materialised",
    ),
}


def attention(fields, seed=0):
    attn = RelPosAttention(
        16, 2, 8, AttentionConfig(backend="blocks", query_chunk=3, **fields)
    ).double()
    randomize(attn, seed)
    return attn


def call_and_inputs(attn, x, mems):
    call, _, q_position = attn.kernel_call(x, mems, AttentionOptions())
    return call, call.score_inputs(q_position)


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_block_map_equals_the_materialised_one(name):
    """Each block's mask as the kernel reads it (rows in its order) equals the sum of
    call.additive_terms with -inf where a key is hidden; the Hankel layout is a view of the curve
    (no map in memory)."""
    fields, layout = LAYOUTS[name]
    attn = attention(fields)
    gen = torch.Generator().manual_seed(1)
    x, mems = (
        torch.randn(2, 7, 16, generator=gen, dtype=torch.float64),
        torch.randn(2, 4, 16, generator=gen, dtype=torch.float64),
    )
    call, inputs = call_and_inputs(attn, x, mems)
    maps, reference = block_maps(call, inputs), MaterialisedMaps(call, inputs)
    kind = (
        "materialised"
        if isinstance(maps, MaterialisedMaps)
        else "hankel"
        if maps.reversed
        else "term_b"
    )
    assert kind == layout
    for blk in call.blocks(64, windowed=True):
        mask = maps.additive_map(blk)
        expected = reference.additive_map(blk).expand_as(mask)
        if kind == "hankel":
            assert mask.untyped_storage().data_ptr() == maps.curve.untyped_storage().data_ptr()
            mask = mask.flip(2)
        torch.testing.assert_close(mask.expand_as(expected), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_tensor_op_forward_equals_the_fused_kernel(name, monkeypatch):
    """Off CPU the kernel's forward is tensor ops (and its backward always is, but for maps nobody
    differentiates): outputs and every gradient equal the fused CPU kernel's and the explicit
    scores'."""
    fields, _ = LAYOUTS[name]
    attn = attention(fields, seed=2)
    gen = torch.Generator().manual_seed(3)
    x, mems = (
        torch.randn(2, 7, 16, generator=gen, dtype=torch.float64),
        torch.randn(2, 4, 16, generator=gen, dtype=torch.float64),
    )
    fused, explicit = fast_and_explicit_gradients(attn, x, mems, AttentionOptions())
    monkeypatch.setattr(kernels, "_fused", lambda q: False)
    unfused, _ = fast_and_explicit_gradients(attn, x, mems, AttentionOptions())
    for a, b, c in zip(fused, unfused, explicit):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(a, c, rtol=1e-7, atol=1e-10)


def test_a_map_nobody_differentiates_takes_the_fused_backward():
    """Fixed ALiBi on term a: no input of the map needs a gradient, so the CPU flash kernel's own
    backward computes dQ, dK, dV (the hand-written one is not called), equal to the explicit scores'
    gradients."""
    attn = attention(dict(terms="a", bias="alibi"), seed=4)
    x, mems = torch.randn(2, 7, 16, dtype=torch.float64), torch.randn(2, 4, 16, dtype=torch.float64)
    called = []
    original = kernels._probabilities
    kernels._probabilities = lambda *a: called.append(1) or original(*a)
    try:
        fast, slow = fast_and_explicit_gradients(attn, x, mems, AttentionOptions())
    finally:
        kernels._probabilities = original
    assert not called
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def test_strided_layout_only_where_the_map_depends_on_the_distance_alone():
    attn = attention(dict(terms="ab", bias="t5", num_buckets=8, max_distance=6))
    x, mems = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 3, 16, dtype=torch.float64)
    call, inputs = call_and_inputs(attn, x, mems)
    assert isinstance(block_maps(call, inputs), StridedMaps)
    padded = call.with_geometry(key_padding_mask=torch.zeros(2, 8, dtype=torch.bool))
    assert isinstance(block_maps(padded, inputs), MaterialisedMaps)
    scaled = inputs._replace(query_scale=torch.ones(1, 1, 5, 1, dtype=torch.float64))
    assert isinstance(block_maps(call, scaled), MaterialisedMaps)


TILED = {
    **{
        name: LAYOUTS[name][0]
        for name in ("t5", "term_d_window", "xl_abcd", "xl_kerple_bidir", "fox")
    },
    "fire_pairs": dict(terms="ab", bias="fire"),
    "cope_fox": dict(terms="a", cope_positions=3, forget_gate=True),
}


@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
@pytest.mark.parametrize("name", TILED)
def test_several_key_tiles_per_block(name, padded, monkeypatch):
    """Tiles of 2-3 keys: forward merges each block's tiles by their log-sum-exp (every query sees a
    key of every tile, windows included), backward adds their gradients (materialised maps: key
    padding, FIRE past its threshold, FoX; CoPE keeps whole rows); both equal the explicit
    scores'."""
    monkeypatch.setattr(layouts, "tile_scores", lambda call, d_head: 4)
    monkeypatch.setattr(materialised_maps, "MATERIALISED_ROWS", 2)
    attn = attention(TILED[name], seed=5)
    gen = torch.Generator().manual_seed(6)
    x, mems = (
        torch.randn(2, 7, 16, generator=gen, dtype=torch.float64),
        torch.randn(2, 4, 16, generator=gen, dtype=torch.float64),
    )
    call, inputs = call_and_inputs(attn, x, mems)
    maps = block_maps(call, inputs)
    # several query blocks per range of keys, several ranges
    if isinstance(maps, MaterialisedMaps) and maps.rows:
        groups = maps.key_tiles(call, 8)
        assert len(groups) > 1 and max(len(tiles) for _, tiles in groups) > 1
    elif not TILED[name].get("cope_positions"):
        assert max(len(tiles) for tiles in maps.backward_blocks(call, 8)) > 1
    if maps.forward_tiles:
        assert max(len(tiles) for tiles in maps.forward_blocks(call, 8)) > 1
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[0, :5] = padded  # the first query sees no key of the first two tiles
    padding[1, 8] = padded
    options = AttentionOptions(key_padding_mask=padding)
    for fast, slow in zip(*fast_and_explicit_gradients(attn, x, mems, options)):
        torch.testing.assert_close(fast, slow, rtol=1e-7, atol=1e-10)


STRIDED = {
    "xl_abcd_memory": (dict(terms="abcd"), "term_b"),
    "xl_window": (dict(terms="abcd", window=5), "term_b"),
    "xl_kerple_bidir": (dict(terms="ab", bias="kerple_log", causal=False), "term_b"),
    "t5": (dict(terms="a", bias="t5", num_buckets=8, max_distance=6), "hankel"),
    "term_d_window": (dict(terms="ad", window=4, bias="alibi"), "hankel"),
    "kerple_bidir": (dict(terms="a", bias="kerple_power", causal=False), "hankel"),
}


def small_strided_tiles(monkeypatch):
    """The strided maps' backward in key ranges of 3 keys and blocks of 2 queries (the tiles of a
    range then start and end inside it: the diagonal, windows, memory)."""
    monkeypatch.setattr(layouts, "TERM_B_ROWS", (2, 2))
    monkeypatch.setattr(layouts, "HANKEL_ROWS", 2)
    monkeypatch.setattr(layouts, "tile_scores", lambda call, d_head: 6)


def strided_call(name, seed=0):
    fields, layout = STRIDED[name]
    attn = attention(fields, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x, mems = (
        torch.randn(2, 9, 16, generator=gen, dtype=torch.float64),
        torch.randn(2, 4, 16, generator=gen, dtype=torch.float64),
    )
    return attn, x, mems, layout


@pytest.mark.parametrize("name", STRIDED)
def test_strided_tiles_by_keys_cover_every_visible_pair_once(name, monkeypatch):
    small_strided_tiles(monkeypatch)
    attn, x, mems, layout = strided_call(name)
    call, inputs = call_and_inputs(attn, x, mems)
    maps = block_maps(call, inputs)
    assert isinstance(maps, StridedMaps) and maps.reversed == (layout == "hankel")
    count = torch.zeros(call.n_queries, call.n_keys, dtype=torch.long)
    groups = maps.key_tiles(call, 8)
    assert len(groups) > 2
    for keys, tiles in groups:
        assert keys.stop - keys.start == 3 or keys.stop == call.n_keys
        for tile in tiles:
            assert keys.start <= tile.k0 < tile.n_keys <= keys.stop and tile.i1 - tile.i0 <= 2
            count[tile.rows, tile.k0 : tile.n_keys] += 1
    visible = call.visible(call.block(0, call.n_queries))
    assert (count[visible] == 1).all() and count.max() == 1


@pytest.mark.parametrize("name", STRIDED)
def test_strided_backward_in_small_key_ranges_equals_the_explicit_path(name, monkeypatch):
    """Every gradient through the strided maps' own backward loop (term b: dS in the per-distance
    layout; Hankel: the curve's view as the product's accumulator; dK and dV summed per range of
    keys, a tile's range partly outside the tile) equals the explicit scores' (float64)."""
    small_strided_tiles(monkeypatch)
    attn, x, mems, _ = strided_call(name, seed=7)
    called = []
    original = kernels.strided_backward
    monkeypatch.setattr(kernels, "strided_backward", lambda *a: called.append(1) or original(*a))
    for fast, slow in zip(*fast_and_explicit_gradients(attn, x, mems, AttentionOptions())):
        torch.testing.assert_close(fast, slow, rtol=1e-7, atol=1e-10)
    assert called


def test_term_b_equals_the_float64_reference_at_4096_with_memory():
    """fp32 XL abcd (sinusoidal R) on the block kernel vs float64, L = 4096 after 256 memory keys:
    the per-distance scores with the curve and -lse as channels of the product (an -inf among them:
    the hidden distances), key ranges of 544 keys with tiles ending inside them; the output within
    1e-5, every parameter's gradient within 1e-5 of its largest entry."""
    from fixtures.kernels import assert_matches_float64, band_layer, band_reference

    attn = band_layer(dict(terms="abcd"), backend="blocks", heads=2, d_head=16)
    with torch.no_grad():
        for p in attn.parameters():
            p.mul_(0.5)
    gen = torch.Generator().manual_seed(1)
    x, mems = torch.randn(1, 4096, 32, generator=gen), torch.randn(1, 256, 32, generator=gen)
    call, _, q_position = attn.kernel_call(x, mems, AttentionOptions())
    maps = block_maps(call, call.score_inputs(q_position))
    assert isinstance(maps, StridedMaps) and len(maps.key_tiles(call, 16)) > 4
    out, _ = attn(x, mems)
    ref, params = band_reference(attn, x, mems)
    assert_matches_float64(attn, out, ref, params, gen, 1e-5, lambda name: 1e-5)


def test_windowed_blocks_hold_as_many_rows_as_the_budget_allows():
    """A block of n queries under a window W reads at most n + W - 1 keys: blocks are sized by that
    (the most rows whose n x (n + W - 1) fits the budget), not by the keys of a block of query_chunk
    queries."""
    attn = RelPosAttention(
        16, 2, 8, AttentionConfig(backend="blocks", query_chunk=64, window=16, bias="alibi")
    )
    call, _ = call_and_inputs(attn, torch.randn(1, 300, 16), None)
    budget, window = 1000, 16
    most = max(n for n in range(1, 65) if n * (n + window - 1) <= budget)  # 25 rows x 40 keys
    blocks = call.blocks(budget, windowed=True)
    assert [blk.i1 - blk.i0 for blk in blocks[:-1]] == [most] * (len(blocks) - 1)
    assert all((blk.i1 - blk.i0) * blk.width <= budget for blk in blocks)
    assert max(blk.width for blk in blocks) == most + window - 1
