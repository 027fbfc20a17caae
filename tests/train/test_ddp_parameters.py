"""Every configuration trains under DDP's defaults (find_unused_parameters off): a model builds only
the parameters its forward uses, for each of the 15 term subsets, every preset and the axes that add
parameters (sinks, temperature, FoX, CoPE, Shaw values, unshared u/v and biases).

DDP stops at the second step when a parameter got no gradient in the first ("parameters that were
not used in producing the loss"). Covered here: one backward gives every parameter a gradient (one
process); 2 gloo processes wrap each configuration in DistributedDataParallel and take 2 steps; a
checkpoint written when the projections no term reads were still built (every attention had q_net
and the keys' half of kv_net) loads and resumes. The real 2-process Lightning runs with terms d are
in tests/train/test_ddp_faults.py.
Run: pytest tests/train/test_ddp_parameters.py -q   (about 10 s)
"""

import faulthandler
import gc
import itertools
import shutil
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from relpos_ablate.config import load_run_config
from relpos_ablate.config.presets import presets
from relpos_ablate.model import TransformerLM
from relpos_ablate.train.module import build_optimizer, without_unread_projections
from relpos_ablate.train.run import train_run

TERM_SUBSETS = [
    "".join(letters) for n in range(1, 5) for letters in itertools.combinations("abcd", n)
]
#: Axes that add parameters, on the term subsets where a projection is left out.
AXES = {
    "d_sinks_temperature": {"terms": "d", "sinks": 2, "learned_temperature": True},
    "c_fox_log_n": {"terms": "c", "forget_gate": True, "score_scale": "log_n", "log_n_length": 8},
    "b_learned_shaw_values": {"terms": "b", "rel": "learned", "clamp_len": 4, "shaw_values": True},
    "bd_unshared_t5": {
        "terms": "bd",
        "share_uv": False,
        "share_bias": False,
        "bias": "t5",
        "num_buckets": 8,
        "max_distance": 6,
    },
    "cd_window_fire": {"terms": "cd", "window": 4, "bias": "fire"},
    "ac_cope_sinks": {"terms": "ac", "cope_positions": 6, "sinks": 1},
    "a_plumbing": {
        "terms": "a",
        "absolute": "rope",
        "qk_norm": "rms",
        "output_gate": "headwise",
        "sink_logit": "learned",
        "canon_width": 2,
    },
}
# a model built outside a run gives log-n scaling its training length itself (a run fills it in:
# resolve_log_n_length)
RUNNABLE_PRESETS = {
    name: {
        **fields,
        **({"log_n_length": 8} if fields.get("score_scale") in ("log_n", "ssmax") else {}),
        # MLA's rotary part below these models' d_head of 8
        **({"qk_rope_dim": 4} if fields.get("qk_rope_dim") else {}),
    }
    for name, fields in presets().items()
}
CONFIGS = {**{f"terms_{t}": {"terms": t} for t in TERM_SUBSETS}, **RUNNABLE_PRESETS, **AXES}
VOCAB = 11
DEADLINE, DUMP_AFTER, EXIT_GRACE = 240, 200, 30
"""Seconds: the DDP check fails at DEADLINE unless both processes have trained every configuration;
each process still running at DUMP_AFTER prints its threads' stacks first (alone the check takes ~10
s). Processes that have trained every configuration (each writes a marker) but not exited EXIT_GRACE
later are killed with a warning. That hang on exit was a deadlock in torch's teardown (the last DDP
model destroyed at interpreter exit: see _two_steps_of_every_config); with the model dropped before
the group is destroyed, 16 of 16 trials exited (2 of 3 had hung before). The kill stays as a
guard."""


def model_config(fields: dict, *extra: str):
    overrides = [f"model.attention.{key}={value}" for key, value in fields.items()]
    return load_run_config(
        None,
        [
            *overrides,
            f"model.vocab_size={VOCAB}",
            "model.d_model=16",
            "model.n_heads=2",
            "model.d_head=8",
            "model.d_inner=16",
            "model.n_layers=2",
            *extra,
        ],
    ).model


@pytest.mark.parametrize("name", CONFIGS)
def test_one_backward_reaches_every_parameter(name):
    torch.manual_seed(0)
    model = TransformerLM(model_config(CONFIGS[name], "model.mem_len=8"))
    logits, mems = model(torch.randint(0, VOCAB, (2, 8)))
    logits, _ = model(torch.randint(0, VOCAB, (2, 8)), mems)  # and with memory
    logits.square().mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_a_projection_is_built_exactly_when_a_term_reads_it():
    """q for terms a and b; k (the first half of kv_net) for terms a and c; v always."""
    for terms in TERM_SUBSETS:
        attn = TransformerLM(model_config({"terms": terms})).layers[0].attn
        assert (attn.q_net is not None) == bool(set(terms) & set("ab")), terms
        assert attn.kv_net.weight.shape == (16 * (2 if set(terms) & set("ac") else 1), 16), terms


def _two_steps_of_every_config(rank: int, world: int, store: str) -> None:
    """One process of the DDP check: every configuration, wrapped as Lightning's DDP wraps it, 2 SGD
    steps."""
    torch.set_num_threads(1)  # two processes on a 2-core machine
    # a process that hangs says where before the deadline kills it
    faulthandler.dump_traceback_later(DUMP_AFTER)
    # a file store, not a TCP port picked free before the processes start: nothing else can take it
    # meanwhile
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        for name, fields in CONFIGS.items():
            torch.manual_seed(0)
            model = DistributedDataParallel(TransformerLM(model_config(fields)))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            tokens = torch.randint(
                0, VOCAB, (2, 2, 8), generator=torch.Generator().manual_seed(rank)
            )
            # DDP finds a parameter that got no gradient when the next step starts
            for step in range(2):
                try:
                    logits, _ = model(tokens[step])
                except RuntimeError as err:
                    raise RuntimeError(f"{name}, step {step}: {err}") from None
                logits.square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
        # the last DDP model's Reducer holds the process group: left to the interpreter's exit, its
        # destructor joins gloo's worker thread while holding the GIL, and that thread waits for the
        # GIL to drop a Python object of its thread-local state: a deadlock (gdb: ~Reducer ->
        # ~ProcessGroupGloo -> thread join; pt_gloo_runloop in ~ThreadLocalState ->
        # gil_scoped_acquire). Dropped here, destroy_process_group frees the group itself
        del model, optimizer
        gc.collect()
        trained_marker(store, rank).write_text("every configuration trained")
    finally:
        dist.destroy_process_group()


def trained_marker(store: str, rank: int) -> Path:
    """The file a process of the DDP check writes once it has trained every configuration."""
    return Path(f"{store}.done{rank}")


@pytest.mark.process_group
def test_every_config_trains_under_ddp_on_two_gloo_processes(tmp_path):
    """Spawned, not forked: a child forked from a test process that has compiled something
    (inductor's worker pool) or started OpenMP threads can inherit a held lock and hang; a fresh
    interpreter costs an import of torch (a few seconds). A process that hangs prints its stacks,
    then fails the test after 4 minutes instead of pytest's 10; processes that trained every
    configuration and hang only on exit are killed (EXIT_GRACE) with a warning."""
    store = str(tmp_path / "store")
    processes = mp.start_processes(
        _two_steps_of_every_config, args=(2, store), nprocs=2, join=False, start_method="spawn"
    )
    deadline, trained = time.monotonic() + DEADLINE, None
    while not processes.join(timeout=1.0):  # True once both have exited; raises a process's error
        now = time.monotonic()
        if trained is None and all(trained_marker(store, rank).exists() for rank in range(2)):
            trained = now
        if now >= deadline or (trained is not None and now - trained > EXIT_GRACE):
            for process in processes.processes:
                process.kill()
            if trained is None:
                pytest.fail(
                    f"the DDP check was still running after {DEADLINE} s (stacks above, from "
                    f"{DUMP_AFTER} s)"
                )
            warnings.warn(
                f"both DDP processes trained every configuration but had not exited {EXIT_GRACE} "
                f"s later (stacks above if it was past {DUMP_AFTER} s); killed",
                stacklevel=1,
            )
            return


@pytest.mark.parametrize("saved, built", [("ad", "d"), ("ab", "b"), ("ac", "c")])
def test_weights_and_optimizer_state_saved_with_unread_projections_load(saved, built):
    """Checkpoints written while every attention built q_net and both halves of kv_net: a model
    whose terms add a to these has exactly that layout. Its weights load strictly (load_run,
    Lightning) and its AdamW moments map onto the parameters the model builds, the value rows of
    kv_net included."""
    train = load_run_config(None, []).train
    torch.manual_seed(0)
    old = TransformerLM(model_config({"terms": saved}))
    optimizer, _ = build_optimizer(old, train, torch.device("cpu"))
    old(torch.randint(0, VOCAB, (2, 8)))[0].square().mean().backward()
    optimizer.step()
    model = TransformerLM(model_config({"terms": built}))
    model.load_state_dict(old.state_dict())  # strict
    new_optimizer, _ = build_optimizer(model, train, torch.device("cpu"))
    new_optimizer.load_state_dict(without_unread_projections(model, optimizer.state_dict()))
    old_params = dict(old.named_parameters())
    rows = model.layers[0].attn.kv_net.weight.shape[0]
    for name, p in model.named_parameters():
        expected = old_params[name][-rows:] if name.endswith("kv_net.weight") else old_params[name]
        assert torch.equal(p, expected), name
        for moment in ("exp_avg", "exp_avg_sq"):
            saved_moment = optimizer.state[old_params[name]][moment]
            expected = saved_moment[-rows:] if name.endswith("kv_net.weight") else saved_moment
            assert torch.equal(new_optimizer.state[p][moment], expected), (name, moment)


@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_a_run_resumes_from_a_checkpoint_with_unread_projections(tmp_path):
    """Through Lightning: the checkpoint of a terms-ad run (the layout every terms-d run had)
    resumes a terms-d run at its step."""
    from fixtures.training import tiny

    short = ("train.log_every=1", "eval.settings=[{segment_len: 16}]")
    assert (
        train_run(tiny("model.attention.terms=ad", "train.max_steps=2", *short), tmp_path / "saved")
        == "done"
    )
    shutil.copytree(tmp_path / "saved" / "checkpoints", tmp_path / "run" / "checkpoints")
    assert (
        train_run(tiny("model.attention.terms=d", "train.max_steps=4", *short), tmp_path / "run")
        == "done"
    )
    with open(tmp_path / "run" / "metrics.csv") as f:
        # resumed at step 2
        assert [row.split(",")[0] for row in f.read().split()[1:]] == ["2", "3"]
