"""The low-rank kernel (ALiBi, learned ALiBi, FoX as one key channel on the flash kernel), the
kernel calibration (measure once per machine, cache, pin) and the denormal setting.

The reference is written out here in float64 with every score materialised: s·q_i·k_j - m_h·(i' - j)
for ALiBi, + Σ_{l=j+1..i'} log f_l for FoX (as a difference of cumulative sums, in float64), masked
causally, softmax, times v, through W_o; its gradients by float64 autograd."""

import functools
import json
import math

import pytest
import torch

from fixtures.kernels import assert_candidates_agree, assert_matches_float64, forced_calibration
from fixtures.reference import reference_attention
from relpos_ablate import AttentionConfig, ConfigError, RelPosAttention
from relpos_ablate.model.core.options import AttentionOptions
from relpos_ablate.model.kernels import calibration, dispatch, low_rank

LOW_RANK = {
    "alibi": dict(bias="alibi"),
    "alibi_learned": dict(bias="alibi_learned"),
    "fox": dict(forget_gate=True),
    "fox_alibi": dict(bias="alibi", forget_gate=True),
}


def _layer(
    name: str, backend: str = "low_rank", heads: int = 2, d_head: int = 16, seed: int = 0, **config
):
    torch.manual_seed(seed)
    config = AttentionConfig(terms="a", backend=backend, **LOW_RANK[name], **config)
    attn = RelPosAttention(heads * d_head, heads, d_head, config)
    if name == "alibi_learned":  # the steepest and the shallowest of the paper's slopes for 8 heads
        with torch.no_grad():
            attn.bias_scheme.log_slopes.copy_(torch.tensor([0.5, 1 / 256]).log())
    return attn


def _limit(name: str) -> float:
    """Gradient tolerance relative to the largest entry: the sums that cancel get more (see the 4096
    test)."""
    return 1e-4 if "forget_gate" in name else 5e-5 if "slopes" in name else 1e-5


def _reference(
    attn: RelPosAttention, x: torch.Tensor, mems: torch.Tensor
) -> tuple[torch.Tensor, list]:
    """(out, the float64 parameters it was computed from) by the formula, everything
    materialised."""
    params = {name: p.detach().double().requires_grad_() for name, p in attn.named_parameters()}
    h, dh = attn.n_heads, attn.d_head
    x, cat = x.double(), torch.cat([mems, x], dim=1).double()
    b, lq, n_keys = x.shape[0], x.shape[1], cat.shape[1]
    n_mem = n_keys - lq
    q = (x @ params["q_net.weight"].T).view(b, lq, h, dh).transpose(1, 2)
    k, v = (cat @ params["kv_net.weight"].T).view(b, n_keys, 2, h, dh).permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
    distance = (n_mem + torch.arange(lq))[:, None] - torch.arange(n_keys)[None, :]  # i' - j
    cfg = attn.config
    if cfg.bias == "alibi":
        slopes = torch.tensor(attn.bias_scheme.slopes.tolist(), dtype=torch.float64)
        scores = scores - slopes[:, None, None] * distance.double()
    if cfg.bias == "alibi_learned":
        scores = scores - params["bias_scheme.log_slopes"].exp()[:, None, None] * distance.double()
    if cfg.forget_gate:
        log_f = torch.nn.functional.logsigmoid(
            cat @ params["forget_gate.proj.weight"].T + params["forget_gate.proj.bias"]
        )
        lam = log_f.cumsum(1).transpose(1, 2)  # (B, H, K): Λ_j = Σ_{l<=j} log f_l
        scores = scores + lam[:, :, n_mem:, None] - lam[:, :, None, :]
    scores = scores.masked_fill(distance < 0, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, lq, h * dh) @ params[
        "out_net.weight"
    ].T
    return out, params


@pytest.fixture(params=[True, False], ids=["sums_in_order", "blocks"])
def ordered(request, monkeypatch):
    """The kernel both ways: one block with the queries' channels (where this machine's flash kernel
    sums channels in order: low_rank.ordered_sums), and query blocks centred in float64 (the rest).
    The first is skipped where the machine's sums are not in order (it would not be chosen
    there)."""
    if request.param and not low_rank.ordered_sums():
        pytest.skip("this machine's CPU flash kernel does not sum a score's channels in order")
    monkeypatch.setattr(low_rank, "ordered_sums", lambda: request.param)
    return request.param


# both kinds of offset (fixed ALiBi: below)
@pytest.mark.parametrize("name", ["alibi_learned", "fox_alibi"])
def test_low_rank_equals_the_float64_reference_at_4096_with_memory(name):
    """fp32 on the low-rank kernel as this machine runs it (one block where its sums are in order,
    else blocks; both ways at small shapes: the loop reference below) vs float64, L = 4096 after 256
    memory keys: the output within 1e-5, every projection's gradient within 1e-5 of its largest
    entry. Two gradients sum millions of terms that cancel (a softmax's rows sum to zero): the
    learned slopes' (Σ dS_ij·(i' - j); 1.1e-5 .. 1.4e-5 in one block, 1.3e-5 in blocks, the block
    kernel 3e-7) within 5e-5, FoX's gate's (a reverse cumulative sum of column sums; 1.6e-6 ..
    1.4e-5 in one block, 1e-5 in blocks, the block kernel 3e-4) within 1e-4."""
    attn = _layer(name)
    gen = torch.Generator().manual_seed(1)
    x, mems = torch.randn(1, 4096, 32, generator=gen), torch.randn(1, 256, 32, generator=gen)
    call, q, _ = attn.kernel_call(x, mems)
    assert dispatch.candidates(call, q, attn.config, 0.0) == ["low_rank"]
    assert (
        low_rank.block_size(low_rank.key_offsets(call), 4096) == 4096
    ) == low_rank.ordered_sums()
    out, _ = attn(x, mems)
    ref, params = _reference(attn, x, mems)
    assert_matches_float64(attn, out, ref, params, gen, 1e-5, _limit)


@functools.cache
def _loop_case(name: str) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the layer's state, x, mems, tests/fixtures/reference.py's output) of the small case of
    `name`. The reference reads only the layer and the inputs, never the kernel: computed once for
    both ways of running the kernel (`ordered`), not once each (FoX's decay pair by pair takes ~1
    s)."""
    attn = _layer(name)
    gen = torch.Generator().manual_seed(2)
    x, mems = torch.randn(2, 70, 32, generator=gen), torch.randn(2, 9, 32, generator=gen)
    ref, _ = reference_attention(attn, x, mems)
    return {k: v.detach().clone() for k, v in attn.state_dict().items()}, x, mems, ref


@pytest.mark.parametrize("name", list(LOW_RANK))
def test_low_rank_equals_the_loop_reference(name, ordered, monkeypatch):
    """Small shapes against tests/fixtures/reference.py's pair-by-pair formula: in one block, and in
    blocks of 32 (a short last block, past parts and memory all occur)."""
    attn = _layer(name)
    state, x, mems, ref = _loop_case(name)
    # the layer the shared reference was computed from, exactly
    assert state.keys() == attn.state_dict().keys()
    assert all(torch.equal(value, state[key]) for key, value in attn.state_dict().items())
    monkeypatch.setattr(low_rank, "MIN_BLOCK", 16)
    monkeypatch.setattr(low_rank, "MAX_BLOCK", 32)
    call, q, _ = attn.kernel_call(x, mems)
    assert dispatch.candidates(call, q, attn.config, 0.0) == ["low_rank"]
    assert low_rank.block_size(low_rank.key_offsets(call), 70) == (70 if ordered else 32)
    out, _ = attn(x, mems)
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=0)


def test_in_float64_the_offsets_stay_float64(ordered):
    """A float64 layer on the kernel matches the formula in float64 (`_reference`) to float64's
    rounding, both ways: its offsets are not cut to two fp32 parts (in one block those err ~2^-48 of
    e / s: 1.5e-13 here, 2.5e-14 kept float64; L = 1000 after 24 memory keys, ALiBi's slopes and
    FoX's gates)."""
    attn = _layer("fox_alibi").double()
    gen = torch.Generator().manual_seed(6)
    x, mems = (torch.randn(1, n, 32, generator=gen, dtype=torch.float64) for n in (1000, 24))
    call, q, _ = attn.kernel_call(x, mems)
    assert dispatch.candidates(call, q, attn.config, 0.0) == ["low_rank"]
    with torch.no_grad():
        out, _ = attn(x, mems)
    ref, _ = _reference(attn, x, mems)
    assert (out - ref).abs().max() <= 8e-14


def test_the_check_of_ordered_sums_tells_the_two_apart():
    """low_rank.matches_float64 fails where the queries' channels are zero in one block (the offsets
    then round with their size, whatever the order of the sums): the check can say no. Where it says
    yes, one block with the queries' channels matched float64 on this machine."""
    assert not low_rank.matches_float64(False)
    assert low_rank.ordered_sums() == low_rank.matches_float64(True)


def test_every_calibration_candidate_agrees():
    """Each kernel calibration can choose computes the same forward and gradients (fp32)."""
    for name in LOW_RANK:
        assert_candidates_agree(
            lambda backend, name=name: _layer(name, backend),
            ("low_rank", "blocks", "sdpa"),
            _limit,
            name,
        )


def test_the_kernel_only_takes_calls_of_key_offsets():
    """A window, key padding, explicit positions or another term send the call to the block
    kernel."""
    attn = _layer("alibi")
    x = torch.randn(1, 40, 32)
    for options in (
        AttentionOptions(window=8),
        AttentionOptions(positions=torch.arange(40) * 2),
        AttentionOptions(key_padding_mask=torch.zeros(1, 40, dtype=torch.bool)),
    ):
        call, q, _ = attn.kernel_call(x, None, options)
        assert dispatch.candidates(call, q, attn.config, 0.0) == ["blocks"]
    for other in (dict(bias="t5"), dict(bias="alibi", sinks=2), dict(bias="alibi", terms="ab")):
        auto = RelPosAttention(32, 2, 16, AttentionConfig(**{"terms": "a", **other}))
        call, q, _ = auto.kernel_call(x)
        assert "low_rank" not in dispatch.candidates(call, q, auto.config, 0.0)
    with pytest.raises(ConfigError, match="backend.*.low_rank. takes causal attention"):
        AttentionConfig(terms="a", bias="t5", backend="low_rank")


def test_offsets_too_steep_for_fp32_leave_the_kernel(monkeypatch):
    """Where sums are not in order, a slope whose offsets spread over more than SPREAD_LIMIT within
    the smallest block is not taken; where they are, it is, in one block, and matches float64."""
    attn = _layer("alibi_learned")
    with torch.no_grad():
        attn.bias_scheme.log_slopes.fill_(
            math.log(low_rank.SPREAD_LIMIT / low_rank.MIN_BLOCK * 1.5)
        )
    x = torch.randn(1, 256, 32, generator=torch.Generator().manual_seed(5))
    call, q, _ = attn.kernel_call(x)
    with monkeypatch.context() as patch:
        patch.setattr(low_rank, "ordered_sums", lambda: False)
        assert low_rank.block_size(low_rank.key_offsets(call), 256) is None
        assert dispatch.candidates(call, q, attn.config, 0.0) == ["blocks"]
    if low_rank.ordered_sums():
        assert low_rank.block_size(low_rank.key_offsets(call), 256) == 256
        out, _ = attn(x)
        ref, _ = reference_attention(attn, x, None)
        assert torch.allclose(out.double(), ref, atol=2e-6, rtol=0)


# ----------------------------------------------------------------------------------------------
# calibration
def test_calibration_measures_once_and_caches_per_machine(tmp_path):
    timings = {"low_rank": 3.0, "blocks": 1.0, "sdpa": 2.0}
    cal = calibration.Calibration(tmp_path / "kernels.json", timer=lambda name, run: timings[name])
    assert cal.choose("key", ["low_rank", "blocks", "sdpa"], lambda name: None) == "blocks"
    assert cal.measured == 3
    assert cal.choose("key", ["low_rank", "blocks", "sdpa"], lambda name: None) == "blocks"
    assert cal.measured == 3  # a second call measures nothing
    stored = json.loads((tmp_path / "kernels.json").read_text())
    assert stored[calibration.Calibration.section()]["key"]["choice"] == "blocks"
    assert calibration.processor() in calibration.Calibration.section()
    again = calibration.Calibration(tmp_path / "kernels.json", timer=lambda name, run: 1 / 0)
    # from the file
    assert again.choose("key", ["low_rank", "blocks", "sdpa"], lambda name: None) == "blocks"


def test_the_default_timing_takes_the_candidates_in_turns(tmp_path, monkeypatch):
    """Without a forced timer, one warm-up run each, then rounds in which every candidate runs once;
    each keeps its fastest run (a clock that only slows down: the first round's times)."""
    order, clock = [], iter(range(1000))
    # each interval longer than the last
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: next(clock) ** 2)
    cal = calibration.Calibration(tmp_path / "kernels.json")
    choice = cal.choose("key", ["low_rank", "blocks"], order.append)
    assert order == ["low_rank", "blocks"] * (1 + calibration.ROUNDS)
    seconds = cal.entries["key"]["seconds"]
    assert seconds == {"low_rank": 1, "blocks": 5} and choice == "low_rank" and cal.measured == 2


@pytest.mark.parametrize("fastest", ["low_rank", "blocks", "sdpa"])
def test_forced_timings_pick_each_path(fastest, tmp_path, monkeypatch):
    """Through the model: with forced timings each candidate is chosen and run (it is the kernel
    called)."""
    cal = forced_calibration(monkeypatch, tmp_path, fastest)
    ran = []
    for name, module, function in (
        ("low_rank", low_rank, "attend_low_rank"),
        ("blocks", dispatch, "_blockwise"),
        ("sdpa", dispatch, "_stored"),
    ):
        real = getattr(module, function)
        monkeypatch.setattr(
            module, function, lambda *args, real=real, name=name: (ran.append(name), real(*args))[1]
        )
    attn = _layer("alibi", backend="auto", max_stored_scores_mb=64)  # sdpa may store its maps
    out, _ = attn(torch.randn(1, 64, 32))
    out.sum().backward()
    assert (
        cal.measured == 3
        and sorted(set(ran[:-1])) == ["blocks", "low_rank", "sdpa"]
        and ran[-1] == fastest
    )


def test_a_pinned_backend_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.ENV_SWITCH, "1")
    cal = calibration.Calibration(tmp_path / "k.json", timer=lambda name, run: 1 / 0)
    monkeypatch.setattr(calibration, "CALIBRATION", cal)
    for backend in ("low_rank", "blocks", "sdpa"):
        _layer("fox", backend=backend)(torch.randn(1, 64, 32))[0].sum().backward()
    assert cal.measured == 0 and not (tmp_path / "k.json").exists()


def test_calibration_switch_is_checked(monkeypatch):
    monkeypatch.setenv(calibration.ENV_SWITCH, "yes")
    with pytest.raises(ValueError, match="RELPOS_ABLATE_CALIBRATE: 'yes' is not allowed"):
        calibration.enabled()


def test_denormals_are_flushed_in_this_thread():
    """Set at import (relpos_ablate.model.denormals): 1e-39 (a denormal) times 1 reads as 0."""
    from relpos_ablate.model import denormals

    assert denormals.FLUSHED
    assert (torch.tensor([1e-39]) * 1.0).item() == 0.0
