"""The arithmetic of the GPU reports (benchmarks/mfu.py, benchmarks/grid_cost.py) against numbers
written out by hand from a config's sizes, and benchmarks/train_step.py --presets on CPU at a tiny
size: every encoding preset against NoPE, with its MFU and the paper-scale specs' device-hours. No
wall-clock time is asserted. Run: pytest tests/test_train_step_flops.py -q -p no:cacheprovider"""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from fixtures.runner import write_spec
from relpos_ablate import AttentionConfig, ModelConfig, TransformerLM
from relpos_ablate.config.presets import encoding_words
from relpos_ablate.runner.grid import load_grid

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import grid_cost
import mfu
import train_step

# a tiny model: d_model, d_inner, vocabulary, layers, heads × d_head, segment length, batch
D, DI, V, N_LAYERS, H, DH, L, B = 16, 32, 64, 2, 2, 8, 16, 2


def tiny(**fields) -> ModelConfig:
    sizes = dict(d_model=D, d_inner=DI, vocab_size=V, n_layers=N_LAYERS, n_heads=H, d_head=DH)
    return ModelConfig(**sizes, **fields)


def hand_n() -> int:
    """N by hand: per layer W_q, W_k, W_v, W_o (d × H·d_head each), two LayerNorms (weight and
    bias), the feed-forward's two Linears with biases; the final LayerNorm; the output head V × d
    (tied: the embedding table is not counted again)."""
    per_layer = 4 * D * H * DH + 2 * 2 * D + (D * DI + DI) + (DI * D + D)
    return N_LAYERS * per_layer + 2 * D + V * D


def test_the_step_flops_are_6n_plus_the_attention_term_of_the_nope_twin():
    per_token = 6 * hand_n() + 12 * N_LAYERS * H * DH * L  # causal: not halved
    assert mfu.step_flops(tiny(), L, B) == per_token * L * B
    # a scheme's model counts its NoPE twin's FLOPs: XL's W_R, u and v are not in them
    xl = tiny(attention=AttentionConfig(terms="abcd"))
    assert mfu.step_flops(xl, L, B) == per_token * L * B
    # memory: every query sees L + M keys
    keys = L + 8
    with_memory = (6 * hand_n() + 12 * N_LAYERS * H * DH * keys) * L * B
    assert mfu.step_flops(tiny(mem_len=8), L, B) == with_memory


def test_n_leaves_out_embedding_tables_and_counts_the_head_tied_or_not():
    learned = AttentionConfig(terms="a", absolute="learned", max_position=32)
    for tie in (True, False):
        model = TransformerLM(tiny(tie_weights=tie, attention=learned))
        assert mfu.matmul_params(model) == hand_n()  # the 32 × d position table is not in N
    assert sum(p.numel() for p in model.parameters()) == hand_n() + V * D + 32 * D


def test_mfu_is_achieved_flops_over_the_peak():
    assert mfu.mfu(3e12, 0.01, 1000.0) == pytest.approx(3e12 / 0.01 / 1e15)
    assert mfu.mfu(3e12, 0.01, None) is None


def test_attention_flops_are_flashattentions_count():
    b, h, length, d = 2, 8, 4096, 64
    forward = 4 * b * h * length**2 * d
    assert mfu.attention_flops(b, h, length, d, causal=False, backward=False) == forward
    assert mfu.attention_flops(b, h, length, d, causal=True, backward=False) == forward / 2
    assert mfu.attention_flops(b, h, length, d) == 3.5 * forward / 2  # + backward, 2.5x
    assert mfu.tflops(7e12, 2.0) == 3.5


def test_the_device_peak_comes_from_the_name_or_the_flag(monkeypatch):
    for name, peak in (
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 SXM5 80GB", 989.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100-PCIE-40GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA L40", None),
    ):
        assert mfu.device_peak_tflops(name) == peak, name
    assert mfu.device_peak_tflops("NVIDIA H200", 500.0) == 500.0
    cpu = torch.device("cpu")
    assert mfu.required_peak_tflops(cpu, None) is None  # no MFU on CPU without a peak
    assert mfu.required_peak_tflops(cpu, 2.0) == 2.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    assert mfu.required_peak_tflops(torch.device("cuda"), 121.0) == 121.0
    with pytest.raises(SystemExit, match="--peak-tflops: no dense bf16 peak known for 'NVIDIA L4'"):
        mfu.required_peak_tflops(torch.device("cuda"), None)


def test_a_spec_costs_its_runs_steps_times_the_step_time(tmp_path):
    """2 seeds × (xl, alibi) × 6 steps: through grid --dry-run's estimate on one slot."""
    spec = write_spec(tmp_path, encodings=("xl", "alibi"), seeds=(0, 1), max_steps=6)
    cost = grid_cost.spec_cost(str(spec), {"xl": 2.0, "alibi": 0.5})
    assert cost["runs"] == 4 and cost["steps"] == 24
    assert cost["device_hours"] == pytest.approx((2 * 6 * 2.0 + 2 * 6 * 0.5) / 3600)
    assert grid_cost.spec_cost(str(spec), 1.5)["device_hours"] == pytest.approx(4 * 6 * 1.5 / 3600)
    doubled = grid_cost.spec_cost(str(spec), 1.5, scale=lambda config: 2.0)
    assert doubled["device_hours"] == pytest.approx(2 * 4 * 6 * 1.5 / 3600)
    with pytest.raises(KeyError, match="no step time for encoding 'alibi'"):
        grid_cost.spec_cost(str(spec), {"xl": 2.0})


def test_costs_scale_a_measured_step_by_the_specs_model_flops(tmp_path):
    spec = write_spec(tmp_path, encodings=("rope",), seeds=(0,), max_steps=10)
    run = load_grid(spec).runs[0].config
    model = dataclasses.replace(run.model, vocab_size=V)  # the spec's data sets its vocabulary
    own = mfu.step_flops(model, run.train.segment_len, run.train.batch_size)
    rows = [{"scheme": "rope", "step_s": 3.0}, {"scheme": "rope", "step_s": 1.0}]  # the faster
    for measured, hours in ((own, 10 * 1.0 / 3600), (2 * own, 10 * 0.5 / 3600)):
        (cost,) = grid_cost.costs(rows, [str(spec)], V, measured)
        assert cost["device_hours"] == pytest.approx(hours)
    (missing,) = grid_cost.costs([{"scheme": "t5", "step_s": 1.0}], [str(spec)], V, own)
    assert "no step time for encoding 'rope'" in missing["missing"]


def test_the_presets_mode_times_every_preset_against_nope_on_cpu(tmp_path):
    out = tmp_path / "presets.json"
    sizes = ["--layers", "1", "--d-model", "16", "--heads", "2", "--d-head", "16", "--d-inner"]
    sizes += ["32", "--length", "16", "--batch", "2", "--vocab", "64"]
    train_step.main(
        [
            "--presets",
            *sizes,
            *("--steps", "1", "--warmup", "1", "--repeats", "1", "--compile", "off"),
            *("--peak-tflops", "1.0", "--out", str(out)),
        ]
    )
    result = json.loads(out.read_text())
    assert [r["scheme"] for r in result["rows"]] == encoding_words()
    assert not [r for r in result["rows"] if "error" in r]
    per_layer = 4 * 16 * 2 * 16 + 4 * 16 + (16 * 32 + 32) + (32 * 16 + 16)
    n = per_layer + 2 * 16 + 64 * 16
    assert result["flops_per_step"] == (6 * n + 12 * 1 * 2 * 16 * 16) * 16 * 2
    for r in result["rows"]:
        assert r["compile"] is False and r["peak_mb"] > 0
        assert r["ratio_to_nope"] == pytest.approx(r["step_s"] / r["nope_step_s"])  # one pair
        assert r["tokens_per_s"] == pytest.approx(16 * 2 / r["step_s"])
        assert r["mfu"] == pytest.approx(result["flops_per_step"] / r["step_s"] / 1e12)
    goals = {r["scheme"]: r["goal"] for r in result["rows"]}
    assert goals["alibi"] == goals["t5"] == goals["rope"] == goals["p_rope"] == 1.1
    assert goals["fox"] == 1.2 and goals["xl"] is None and goals["dape"] is None
    assert result["device"] == "cpu" and result["torch"] and result["date"]
    assert "getrusage" in result["memory"]
    assert [c["spec"] for c in result["costs"]] == ["xl_table6", "alibi_table2"]
    assert all(c["device_hours"] > 0 for c in result["costs"])
    page = out.with_suffix(".md").read_text()
    assert "| scheme | compile | step ms | × NoPE | goal | tokens/s |" in page
    assert "| rope | off |" in page and "- alibi_table2: 4 runs, 400,000 steps:" in page
