"""Evaluation protocols (docs/guide/evaluation.md#evaluation-protocols): which targets each batch
scores, with what context, checked by hand on small layouts; every protocol and length scores every
target of the layout exactly once; a trained run's eval.json and token_losses.npz against an
independent evaluation (every target's window run through the model by hand); loss by position; the
unigram reference.

Run: .venv/bin/python -m pytest tests/train/test_eval_protocols.py -q
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from relpos_ablate.config import ConfigError, EvalSetting, load_run_config
from relpos_ablate.config.data import STREAM_TASKS
from relpos_ablate.train.data import SegmentStreams, build_datamodule
from relpos_ablate.train.data.protocols import (
    EvalLayout,
    SegmentBatches,
    WindowBatches,
    log_bins,
    protocol_batches,
    unigram_loss,
    window_ends,
)
from relpos_ablate.train.run import load_run, train_run


def layout(streams: int, length: int, max_targets: int = 0) -> EvalLayout:
    """Inputs are their own column numbers (stream b holds 100·b + p), so a batch shows where it
    came from."""
    inputs = torch.arange(length)[None] + 100 * torch.arange(streams)[:, None]  # (B, T)
    return EvalLayout(
        SegmentStreams(inputs, inputs + 1, torch.ones(streams, length, dtype=torch.bool), 1),
        max_targets,
    )


def scored(batch):
    """[(stream, target column, tokens of context in the window)] of every target a batch scores."""
    inputs, _targets, mask, _index = batch
    out = []
    for r, j in mask.nonzero().tolist():
        b, p = divmod(int(inputs[r, j]), 100)
        out.append((b, p, j + 1))
    return out


def test_sliding_windows_by_hand_window_4_stride_3():
    """T = 10, L = 4, S = 3: windows [0, 4) scores all four, [3, 7) and [6, 10) their last three."""
    assert window_ends(10, 4, 3).tolist() == [4, 7, 10]
    batches = WindowBatches(layout(1, 10), window=4, stride=3, per_batch=1)
    assert len(batches) == 3
    expected = [
        (0, [(0, 0, 1), (0, 1, 2), (0, 2, 3), (0, 3, 4)]),  # first window: contexts 1..4
        (3, [(0, 4, 2), (0, 5, 3), (0, 6, 4)]),  # contexts L - S + 1 = 2 .. L = 4
        (6, [(0, 7, 2), (0, 8, 3), (0, 9, 4)]),
    ]
    for (start, targets), batch in zip(expected, batches):
        assert batch[0].tolist() == [list(range(start, start + 4))]
        assert scored(batch) == targets
        # layout index b·T + p (B = 1)
        assert batch[3][batch[2]].tolist() == [p for _, p, _ in targets]


def test_sliding_last_window_ends_at_the_stream_end_and_scores_only_new_targets():
    """T = 9, L = 4, S = 3: the last window is [5, 9) and scores only 7 and 8 (3 and 4 tokens of
    context)."""
    assert window_ends(9, 4, 3).tolist() == [4, 7, 9]
    last = WindowBatches(layout(1, 9), window=4, stride=3, per_batch=1)[2]
    assert last[0].tolist() == [[5, 6, 7, 8]]
    assert scored(last) == [(0, 7, 3), (0, 8, 4)]


def test_stride_one_gives_every_later_target_exactly_the_window_as_context():
    batches = WindowBatches(layout(2, 7), window=3, stride=1, per_batch=4)
    targets = [t for batch in batches for t in scored(batch)]
    assert len(batches) == math.ceil(2 * 5 / 4)  # 5 windows per stream, 4 per batch
    for b in range(2):
        mine = sorted((p, context) for stream, p, context in targets if stream == b)
        assert mine == [(0, 1), (1, 2), (2, 3), (3, 3), (4, 3), (5, 3), (6, 3)]


def test_a_stream_shorter_than_the_window_is_one_padded_window():
    (batch,) = list(WindowBatches(layout(1, 3), window=5, stride=2, per_batch=8))
    assert batch[2].tolist() == [[True, True, True, False, False]]
    assert batch[3].tolist() == [[0, 1, 2, -1, -1]]


def test_non_overlapping_pads_and_masks_the_last_partial_segment():
    """T = 10, L = 4: segments [0, 4), [4, 8), [8, 10) + 2 masked columns; every target once, in
    order."""
    batches = SegmentBatches(layout(2, 10), 4)
    assert len(batches) == 3
    inputs, _targets, mask, index = batches[2]
    assert mask.tolist() == [[True, True, False, False]] * 2
    assert index.tolist() == [[8, 9, -1, -1], [18, 19, -1, -1]]
    contexts = [t for batch in batches for t in scored(batch)]
    assert sorted((b, p) for b, p, _ in contexts) == [(b, p) for b in range(2) for p in range(10)]
    assert all(context == p % 4 + 1 for _, p, context in contexts)


@pytest.mark.parametrize("protocol", ["non_overlapping", "sliding", "xl"])
@pytest.mark.parametrize("length", [1, 4, 7, 16, 40])
def test_every_protocol_and_length_scores_every_target_exactly_once(protocol, length):
    grid = layout(3, 23)
    stride = {"sliding": max(1, length // 3)}.get(protocol)
    setting = EvalSetting(
        segment_len=length,
        protocol=protocol,
        stride=stride,
        mem_len=4 if protocol == "xl" else None,
    )
    indices = torch.cat(
        [batch[3][batch[2]] for batch in protocol_batches(grid, setting, sliding_batch_tokens=20)]
    )
    assert sorted(indices.tolist()) == list(range(3 * 23))


def test_token_counts_match_across_settings_exactly_for_the_tasks_the_readme_says():
    """Counts differ for the tasks with a per-segment rule (what determines a target must lie in its
    segment or window), and only for them; the README's Evaluation section names them."""
    settings = [
        EvalSetting(segment_len=16),
        EvalSetting(segment_len=32),
        EvalSetting(segment_len=32, protocol="sliding", stride=8),
    ]
    matching, differing = set(), set()
    for task in STREAM_TASKS:
        datamodule = build_datamodule(
            load_run_config(
                None,
                [f"data.task={task}", "data.eval_tokens=256", "data.period=8", "eval.batch_size=2"],
            )
        )
        streams = datamodule.streams("eval", 16)
        counts = {
            sum(int(batch[2].sum()) for batch in protocol_batches(EvalLayout(streams), s, 64))
            for s in settings
        }
        (matching if len(counts) == 1 else differing).add(task)
        assert (len(counts) == 1) == (streams.segment_mask is None), task
    assert matching == {"repeat"} and differing == {"offset_copy", "recall"}
    guide = (Path(__file__).parents[2] / "docs" / "guide" / "evaluation.md").read_text()
    section = " ".join(guide.split())
    assert (
        "For text and the `repeat` task every target counts, so token counts match across "
        "settings" in section
    )
    assert "`offset_copy` and `recall` count a target only when" in section


def test_max_targets_keeps_the_first_targets_of_every_stream():
    cut = layout(4, 10, max_targets=13)  # 13 // 4 = 3 targets per stream
    assert cut.inputs.tolist() == [[0, 1, 2], [100, 101, 102], [200, 201, 202], [300, 301, 302]]
    assert cut.targets.tolist()[1] == [101, 102, 103] and cut.length == 3


def test_log_bins():
    assert log_bins(16) == [0, 1, 2, 4, 8, 16]
    assert log_bins(48) == [0, 1, 2, 4, 8, 16, 32, 48]
    assert log_bins(1) == [0, 1] and log_bins(2) == [0, 1, 2] and log_bins(3) == [0, 1, 2, 3]


def test_unigram_reference_is_add_one_smoothed_training_frequencies():
    # vocabulary 3, training targets 0, 0, 1 -> counts + 1 = 3, 2, 1 over 6
    loss = unigram_loss(torch.tensor([0, 0, 1]), torch.tensor([[0, 2]]), vocab_size=3)
    assert loss == pytest.approx(-(math.log(3 / 6) + math.log(1 / 6)) / 2)


@pytest.mark.parametrize(
    "setting, field, message",
    [
        (
            "{segment_len: 8, protocol: sliding}",
            "stride",
            "protocol 'sliding' needs a stride (1..segment_len=8)",
        ),
        (
            "{segment_len: 8, protocol: sliding, stride: 9}",
            "stride",
            "9 is out of range; allowed [1, 8]",
        ),
        ("{segment_len: 8, stride: 2}", "stride", "is read only by protocol 'sliding'"),
        ("{segment_len: 8, protocol: sliding, stride: 2, mem_len: 8}", "mem_len", "without memory"),
        (
            "{segment_len: 8, protocol: windows}",
            "protocol",
            "'windows' is not allowed; choose one of non_overlapping, sliding, xl",
        ),
        ("{segment_len: 8, protocol: xl}", "protocol", "'xl' needs causal attention and memory"),
        (
            "{segment_len: 8, max_targets: 3}",
            "max_targets",
            "leaves no target in some of the eval.batch_size=8 streams",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(setting, field, message):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [f"eval.settings=[{setting}]"])
    assert str(err.value).startswith(f"eval.settings[0].{field}: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_recl_ladder_settings_and_their_errors():
    config = load_run_config(None, ["eval.recl_contexts=[8, 16]", "eval.recl_targets=256"])
    ladder = config.eval_settings()[-2:]
    assert [
        (s.segment_len, s.protocol, s.stride, s.max_targets, s.token_losses) for s in ladder
    ] == [(8, "sliding", 1, 256, True), (16, "sliding", 1, 256, True)]
    with pytest.raises(
        ConfigError, match=r"^eval\.recl_contexts: \[16, 8\]: list each context length once"
    ):
        load_run_config(None, ["eval.recl_contexts=[16, 8]"])
    with pytest.raises(
        ConfigError,
        match=r"^eval\.recl_targets: 100 targets in eval\.batch_size=8 streams leave none "
        r"with 16 tokens of context .* use >= 128$",
    ):
        load_run_config(None, ["eval.recl_contexts=[8, 16]", "eval.recl_targets=100"])


# ---------------------------------------------------------------- a trained run, evaluated by hand

TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_head=16",
    "model.d_inner=64",
    "model.dropout=0.0",
    "model.mem_len=8",
    "train.segment_len=8",
    "train.batch_size=8",
    "train.max_steps=30",
    "train.lr=0.003",
    "train.warmup_steps=5",
    "train.log_every=10",
    "train.checkpoint_every=1000",
    "eval.batch_size=3",
    "data.source=text",
]
SETTINGS = (
    "eval.settings=[{segment_len: 8, token_losses: true}, {segment_len: 24, protocol: sliding, "
    "stride: 5, token_losses: true}, {segment_len: 12, protocol: xl, mem_len: 16}, {segment_len: "
    "6, protocol: sliding, stride: 1, max_targets: 90, token_losses: true}]"
)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocols")
    words = ["to", "be", "or", "not", "that", "is", "the", "question"]
    lines = [" ".join(words[(i * 5 + j * 3) % 8] for j in range(7)) for i in range(300)]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[::7][:20]) + "\n")
    config = load_run_config(
        None,
        [
            *TINY,
            f"data.train_file={root / 'train.txt'}",
            f"data.valid_file={root / 'valid.txt'}",
            f"data.cache_dir={root / 'cache'}",
            SETTINGS,
        ],
    )
    assert train_run(config, root / "run") == "done"
    saved = np.load(root / "run" / "token_losses.npz")
    return (
        root / "run",
        json.loads((root / "run" / "eval.json").read_text()),
        {k: saved[k] for k in saved.files},
    )


def eval_streams(run_dir):
    config, model = load_run(run_dir)
    streams = build_datamodule(config).streams("eval", 1)
    return model.double(), streams.inputs.long(), streams.targets.long()


def window_loss(model, inputs, targets, b, p, context, **kwargs) -> float:
    """Loss on target p of stream b with the `context` tokens before it (itself included), computed
    alone."""
    window = inputs[b, p - context + 1 : p + 1][None]
    with torch.no_grad():
        logits, _ = model(window, **kwargs)
    return F.cross_entropy(logits[0, -1], targets[b, p]).item()


def test_every_protocol_scores_the_whole_layout_and_reports_it(evaluated):
    _run_dir, result, _arrays = evaluated
    streams, per_stream = result["layout"]["streams"], result["layout"]["targets_per_stream"]
    assert streams == 3 and per_stream > 24
    tokens = [s["metrics"]["tokens"] for s in result["settings"]]
    # the last keeps 90 // 3 = 30 targets per stream
    assert tokens == [streams * per_stream] * 3 + [90]
    assert [s["attn_len"] for s in result["settings"]] == [8 + 8, 24, 16, 6]
    assert [s["protocol"] for s in result["settings"]] == [
        "non_overlapping",
        "sliding",
        "xl",
        "sliding",
    ]
    assert [s["same_length"] for s in result["settings"]] == [False, False, True, False]


def test_sliding_token_losses_are_each_targets_own_window(evaluated):
    run_dir, result, arrays = evaluated
    model, inputs, targets = eval_streams(run_dir)
    for k, (window, stride) in ((1, (24, 5)), (3, (6, 1))):
        losses = arrays[result["settings"][k]["token_losses"]]
        assert not np.isnan(losses).any()
        for b in range(losses.shape[0]):
            for p in list(range(losses.shape[1]))[:: 7 if stride == 5 else 3]:
                ends = window_ends(losses.shape[1], window, stride).tolist()
                end = next(e for e in ends if e > p)
                start = max(0, end - window)  # the window that scores p
                expected = window_loss(model, inputs, targets, b, p, p - start + 1, mem_len=0)
                assert losses[b, p] == pytest.approx(expected, rel=1e-4, abs=1e-5)
        metrics = result["settings"][k]["metrics"]
        assert metrics["loss"] == pytest.approx(float(losses.astype(np.float64).mean()), rel=1e-6)
        assert metrics["ppl"] == pytest.approx(math.exp(metrics["loss"]))
        assert metrics["bpc"] == pytest.approx(metrics["loss"] / math.log(2))


def test_non_overlapping_with_memory_matches_a_segment_loop_by_hand(evaluated):
    run_dir, result, arrays = evaluated
    model, inputs, targets = eval_streams(run_dir)
    losses, mems, expected = arrays[result["settings"][0]["token_losses"]], None, []
    with torch.no_grad():
        # the last segment is shorter: scored, not dropped
        for start in range(0, inputs.shape[1], 8):
            logits, mems = model(inputs[:, start : start + 8], mems, mem_len=8)
            expected.append(
                F.cross_entropy(
                    logits.transpose(1, 2), targets[:, start : start + 8], reduction="none"
                )
            )
    torch.testing.assert_close(
        torch.from_numpy(losses).double(), torch.cat(expected, 1), rtol=1e-4, atol=1e-5
    )


def test_loss_by_position_bins_the_token_losses_by_their_column(evaluated):
    _run_dir, result, arrays = evaluated
    record = result["settings"][0]  # non_overlapping, L = 8: position = p mod 8
    losses = arrays[record["token_losses"]].astype(np.float64)
    positions = np.arange(losses.shape[1]) % 8
    curve = record["position_loss"]
    assert curve["edges"] == [0, 1, 2, 4, 8]
    for lo, hi, loss, tokens in zip(
        curve["edges"], curve["edges"][1:], curve["loss"], curve["tokens"]
    ):
        chosen = losses[:, (positions >= lo) & (positions < hi)]
        assert tokens == chosen.size and loss == pytest.approx(chosen.mean(), rel=1e-6)


def test_unigram_reference_in_eval_json(evaluated):
    run_dir, result, _arrays = evaluated
    config, _model = load_run(run_dir)
    data = build_datamodule(config)
    train = data.streams("train", 8).targets.flatten()
    counts = np.bincount(train.numpy(), minlength=data.vocab_size) + 1.0
    _model, _inputs, targets = eval_streams(run_dir)
    expected = -np.log(counts / counts.sum())[targets.flatten().numpy()].mean()
    reference = result["reference"]
    assert reference["name"] == "unigram" and reference["metrics"]["loss"] == pytest.approx(
        expected
    )
    assert reference["metrics"]["ppl"] == pytest.approx(math.exp(expected))
