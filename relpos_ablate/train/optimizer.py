"""The optimizer of a run and its schedule: AdamW (weight decay on Linear weights outside bias
schemes only) or Adam, linear warm-up then cosine decay to 0 or constant, each bias scheme's range
restored after every step, and a checkpoint's optimizer state fitted to the attention built now.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from relpos_ablate.config import TrainConfig
from relpos_ablate.model import TransformerLM
from relpos_ablate.model.schemes import bias_schemes


def lr_factor(step: int, train: TrainConfig) -> float:
    """Multiplier of train.lr at optimizer step `step`: linear warm-up, then cosine to 0 or
    constant."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    if train.schedule == "constant":
        return 1.0
    progress = (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: nn.Module, train: TrainConfig, device: torch.device):
    """(optimizer, LambdaLR scheduler). Weight decay applies to Linear weights (incl. a tied
    embedding and W_R, a projection like W_k) outside bias schemes only: norms, biases, u/v,
    position tables and every parameter of a bias scheme (FIRE's and the dynamic MLPs too) are not
    pulled towards zero."""
    decay, rest = parameter_groups(model)
    decay_wd = train.weight_decay if train.optimizer == "adamw" else 0.0
    groups = [{"params": decay, "weight_decay": decay_wd}, {"params": rest, "weight_decay": 0.0}]
    optim_cls = torch.optim.AdamW if train.optimizer == "adamw" else torch.optim.Adam
    optimizer = optim_cls(groups, lr=train.lr, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train))
    return optimizer, scheduler


def parameter_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(decayed, not decayed), each in the order the optimizer holds them (build_optimizer says
    which)."""
    in_schemes = {id(p) for scheme in bias_schemes(model) for p in scheme.parameters()}
    decay = {
        id(m.weight): m.weight
        for m in model.modules()
        if isinstance(m, nn.Linear) and id(m.weight) not in in_schemes
    }
    return list(decay.values()), [p for p in model.parameters() if id(p) not in decay]


def without_unread_projections(model: TransformerLM, state: dict) -> dict:
    """The optimizer state of a checkpoint for this model's optimizer, also when the checkpoint was
    written while every attention built q_net and both halves of kv_net (attention.py loads such
    weights): q_net's entries (decayed, each just before its layer's kv_net) left out where q_net is
    not built, the keys' half of kv_net's moments where W_k is not. Those weights never changed the
    output: the run resumes as it was."""
    decay, rest = parameter_groups(model)
    unbuilt_q = {id(a.kv_net.weight) for a in model.attention_layers() if a.q_net is None}
    old = iter(i for group in state["param_groups"] for i in group["params"])
    legacy = sum(len(group["params"]) for group in state["param_groups"]) > len(decay) + len(rest)
    moments = {}
    for index, p in enumerate(decay + rest):
        if legacy and id(p) in unbuilt_q:
            next(old)  # that layer's q_net
        entry = state["state"].get(next(old))
        if entry is not None:  # [W_k; W_v] moments -> W_v's where only the value rows are built
            moments[index] = {
                k: v[-p.shape[0] :] if torch.is_tensor(v) and v.dim() and v.shape != p.shape else v
                for k, v in entry.items()
            }
    first = [0, len(decay), len(decay) + len(rest)]
    groups = [
        {**group, "params": list(range(a, b))}
        for group, a, b in zip(state["param_groups"], first, first[1:])
    ]
    return {"state": moments, "param_groups": groups}


def after_optimizer_step(model: nn.Module) -> None:
    """Every bias scheme restores its parameters' range once they moved (KERPLE clamps a, p in
    place)."""
    for scheme in bias_schemes(model):
        scheme.after_optimizer_step()
