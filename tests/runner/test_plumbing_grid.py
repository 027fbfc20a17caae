"""Every axis of the attention plumbing (docs/schemes/attention-plumbing.md) trains through the
command line: one tiny grid whose rows switch them on (several per run, so the grid stays small), a
RoPE context extension of each new kind among its evaluation settings, run by `relpos-ablate grid`
on 2 CPU slots; every run ends done with an eval.json."""

import subprocess
import sys

import pytest
import yaml

from fixtures.runner import REPO
from relpos_ablate.io import read_json
from relpos_ablate.rundir import read_status
from relpos_ablate.runner.grid import load_grid

SPEC = {
    "name": "plumbing_tiny",
    "base": {
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_head": 16, "d_inner": 64},
        "data": {
            "source": "synthetic",
            "task": "offset_copy",
            "num_symbols": 8,
            "offset": 2,
            "train_tokens": 2048,
            "eval_tokens": 256,
        },
        "train": {"segment_len": 16, "batch_size": 4, "max_steps": 2, "warmup_steps": 1},
        "eval": {
            "settings": [
                {"segment_len": 16},
                {"segment_len": 32},
                {"segment_len": 32, "rope_scaling": "dynamic"},
                {
                    "segment_len": 32,
                    "rope_scaling": "yarn",
                    "rope_mscale": 1.0,
                    "rope_mscale_all_dim": 0.5,
                    "rope_truncate": False,
                },
                {
                    "segment_len": 32,
                    "rope_scaling": "longrope",
                    "rope_long_factor": [1.0] * 4 + [2.0] * 4,
                    "rope_short_factor": [1.0] * 8,
                },
            ],
            "batch_size": 4,
        },
    },
    "zip": {
        "encoding": ["rope", "nope", "pope", "mla_rope", "grape_a", "grape_ap"],
        "model.attention.qk_norm": ["rms", "l2", "none", "none", "rms", "rms"],
        "model.attention.qk_norm_order": ["after_rope"] + ["before_rope"] * 5,
        "model.attention.output_gate": ["headwise", "elementwise", "none", "none", "none", "none"],
        "model.attention.sink_logit": ["learned", "off_by_one", "none", "none", "none", "none"],
        "model.attention.canon_width": [2, 4, 0, 0, 0, 0],
        "model.attention.rope_heads": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0],
        "model.attention.qk_rope_dim": [0, 0, 0, 8, 0, 0],
        "model.attention.pope_phase_bias": [False, False, True, False, False, False],
    },
    "seeds": [0],
}


@pytest.mark.slow
def test_a_tiny_grid_over_every_plumbing_axis_trains_through_the_cli(tmp_path):
    spec_path = tmp_path / "plumbing_tiny.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC, sort_keys=False))
    results = tmp_path / "results"
    argv = [sys.executable, "-m", "relpos_ablate", "grid", str(spec_path)]
    done = subprocess.run(
        [*argv, "--results", str(results), "--slots", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for run in load_grid(spec_path).runs:
        run_dir = results / "plumbing_tiny" / run.run_id
        assert read_status(run_dir)["state"] == "done"
        settings = read_json(run_dir / "eval.json")["settings"]
        assert [s["segment_len"] for s in settings] == [16, 32, 32, 32, 32]
        scaled = [s for s in settings if s["rope_scaling"]]
        if run.config.model.attention.absolute == "rope":  # d_rot/2 = 8 pairs, 8 factors each
            assert [s.get("error") for s in scaled] == [None, None, None]
        else:  # the extensions apply to absolute: rope only, and say so
            assert all("extends RoPE" in s["error"] for s in scaled)
        assert all(s["metrics"]["loss"] > 0 for s in settings if not s.get("error"))
