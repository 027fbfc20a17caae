"""A run's last checkpoint read back: whether training can resume from it (`usable_checkpoint`), and
its trained weights in a model (`load_run`, `load_weights`) for evaluation and analysis.
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import torch

from relpos_ablate import rundir
from relpos_ablate.config import RunConfig
from relpos_ablate.model import TransformerLM

log = logging.getLogger("relpos_ablate.train")


def usable_checkpoint(run_dir: Path, tidy: bool = True) -> bool:
    """Whether there is a last.ckpt to resume from. Temp files of writes cut short by a kill are
    removed (a held checkpoint, .last.ckpt.staged.tmp, and its own temp files too); a last.ckpt that
    is not a complete torch archive (damaged outside this code: every write here is atomic) is set
    aside as last.ckpt.corrupt and the run starts over, rather than failing again on every rerun.
    Only rank 0 tidies (`tidy`); every process reaches the same answer."""
    last = rundir.last_checkpoint(run_dir)
    if tidy:
        for stale in last.parent.glob(f".*{last.name}.*.tmp"):
            stale.unlink(missing_ok=True)
    if not last.exists():
        return False
    if zipfile.is_zipfile(last):
        return True
    if tidy:
        last.replace(last.with_name(last.name + ".corrupt"))
        log.warning(
            "%s is not a complete checkpoint; set aside as %s.corrupt, training from step 0",
            last,
            last.name,
        )
    return False


def load_run(run_dir: str | Path) -> tuple[RunConfig, TransformerLM]:
    """The run's resolved config (config.yaml) and its model with the trained weights of
    checkpoints/last.ckpt, in eval mode: a trained model to analyse in Python (`from relpos_ablate
    import load_run`). The config imports the modules its `imports:` lists first."""
    config = rundir.stored_config(run_dir)
    if config is None:
        raise FileNotFoundError(f"{Path(run_dir) / rundir.CONFIG} not found: not a run directory")
    model = TransformerLM(config.model)
    load_weights(run_dir, model)
    return config, model.eval()


def load_weights(run_dir: str | Path, model: TransformerLM) -> None:
    """Load the weights of the run's checkpoints/last.ckpt into `model` (built from the run's
    config)."""
    path = rundir.last_checkpoint(run_dir)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: the run has no trained weights yet")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    prefix = "model."
    model.load_state_dict(
        {k[len(prefix) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    )
