"""How a run trains: optimisation and the training loop (`TrainConfig`, the `train:` block of a run
config), which of its fields say how a run executes rather than what it computes (`HOW_TO_RUN`), and
how a batch's streams split over processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from relpos_ablate.config.base import check_choice, check_range, reject

OPTIMIZERS = ("adamw", "adam")
SCHEDULES = ("cosine", "constant")
LOSS_ON = ("full", "half")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
STRATEGIES = ("auto", "ddp")
LOGGERS = ("csv", "tensorboard", "wandb")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the training loop."""

    segment_len: int = 64
    """Tokens per segment (the backprop length, XL's tgt_len)."""
    batch_size: int = 16
    """Contiguous streams per optimizer step, over all processes together (the global batch; each
    row carries its own memory)."""
    max_steps: int = 300
    """Optimizer steps."""
    optimizer: str = "adamw"
    """adamw | adam (XL uses Adam)."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay (ignored by adam)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    schedule: str = "cosine"
    """cosine (to 0 at max_steps) | constant, after warm-up."""
    grad_clip: float = 1.0
    """Clip gradient norm (0: off; XL uses 0.25)."""
    loss_on: str = "full"
    """Loss on the 'full' segment or only its most recent 'half' (XL Table 6)."""
    precision: str = "32-true"
    """Lightning precision: 32-true | bf16-mixed | 16-mixed."""
    accelerator: str = "auto"
    """Lightning accelerator: auto | cpu | gpu. (How to run: not part of the run id.)"""
    devices: int | str = 1
    """Data-parallel copies of the model per node: GPUs with accelerator gpu, processes with cpu;
    "auto": every visible GPU. Rank r of W trains streams [r*B/W, (r+1)*B/W) of the B = batch_size
    streams and keeps their memory, so the run computes the same steps on any number of devices.
    (How to run: not part of the run id.)"""
    num_nodes: int = 1
    """Machines the run spans, each with `devices` copies (SLURM: nodes of one job). (How to
    run.)"""
    strategy: str = "auto"
    """Lightning strategy: auto (ddp when there are several devices) | ddp. (How to run.)"""
    accumulate: int = 1
    """Micro-batches per optimizer step: each device trains its streams in this many groups of rows,
    one after the other, each group with its own memory, and the gradients add up. It lowers memory
    per device (reach a paper's batch_size on fewer GPUs); the step is the same as without it up to
    rounding. (How to run.)"""
    deterministic: bool = False
    """torch deterministic algorithms (slower). (How to run.)"""
    compile: bool = False
    """torch.compile the model's training forward (and so its backward): fused kernels around the
    attention, the same numbers up to rounding. Evaluation runs uncompiled (its lengths would each
    compile again). Inductor traces what it can and runs the rest eagerly: on CPU the attention's
    block kernel (a Python loop over blocks in an autograd.Function) and randomized positions (read
    on the host) break the graph, so the gain there is the layers around the attention
    (docs/performance.md). The first steps pay the compilation (tens of seconds). (How to run: not
    part of the run id.)"""
    loggers: tuple[str, ...] = ("csv",)
    """Where training metrics go, from rank 0: csv (metrics.csv, always written: the run's record
    that collect and plots read) | tensorboard (RUN_DIR/tensorboard/, pip install
    relpos-ablate[tensorboard]) | wandb (run id as name and W&B id, resumed runs continue it; pip
    install relpos-ablate[wandb]). (How to run.)"""
    log_every: int = 10
    """Log training metrics every N steps."""
    checkpoint_every: int = 100
    """Save checkpoints/last.ckpt every N steps (and at the end)."""
    val_every: int = 0
    """Evaluate the first eval setting every N steps during training, logged as val_* (0: only at
    the end, where every setting is evaluated)."""
    stop_at_exact_match: float | None = None
    """Example tasks: stop training once exact match on a held-out set of in-distribution examples
    (stop_examples of them, n drawn from data.train_lengths, a draw of their own) reaches this
    share, checked every stop_check_every steps; max_steps stays the cap. status.json and eval.json
    record the step training stopped at and why (`stopped`). null: train max_steps."""
    stop_check_every: int = 100
    """stop_at_exact_match: steps between two checks (each check is a no-grad pass over
    stop_examples)."""
    stop_examples: int = 512
    """stop_at_exact_match: held-out in-distribution examples per check (standard error of a share
    p: sqrt(p(1-p)/stop_examples), 0.004 at p = 0.99 with 512)."""

    def __post_init__(self):
        for name in ("segment_len", "batch_size", "max_steps", "log_every", "checkpoint_every"):
            check_range(name, getattr(self, name), low=1)
        check_range("val_every", self.val_every, low=0)
        if self.stop_at_exact_match is not None and not 0 < self.stop_at_exact_match <= 1:
            reject(
                "stop_at_exact_match",
                f"{self.stop_at_exact_match!r} is out of range; give a share in (0, 1]",
            )
        check_range("stop_check_every", self.stop_check_every, low=1)
        check_range("stop_examples", self.stop_examples, low=1)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_range("lr", self.lr, low=0.0)
        check_range("weight_decay", self.weight_decay, low=0.0)
        check_range("warmup_steps", self.warmup_steps, low=0)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_range("grad_clip", self.grad_clip, low=0.0)
        check_choice("loss_on", self.loss_on, LOSS_ON)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("accelerator", self.accelerator, ("auto", "cpu", "gpu"))
        if isinstance(self.devices, int):
            check_range("devices", self.devices, low=1)
        elif self.devices != "auto":
            reject("devices", f"{self.devices!r} is not allowed; give a number >= 1 or auto")
        for name in ("num_nodes", "accumulate"):
            check_range(name, getattr(self, name), low=1)
        check_choice("strategy", self.strategy, STRATEGIES)
        for i, name in enumerate(self.loggers):
            check_choice(f"loggers[{i}]", name, LOGGERS)
        if isinstance(self.devices, int) and self.devices >= 1:
            check_streams_split(
                "batch_size", self.batch_size, self.devices * self.num_nodes, self.accumulate
            )


HOW_TO_RUN = (
    "accelerator",
    "devices",
    "num_nodes",
    "strategy",
    "accumulate",
    "deterministic",
    "loggers",
    "compile",
)
"""TrainConfig fields that say how a run executes, not what it computes: the hardware, how one
optimizer step's streams are spread over it, and where metrics are shown. Changing them changes the
numbers at most by floating-point rounding (summation order, different kernels; with dropout, each
process draws its own masks: the same distribution, other draws), so they are not part of the run
id: the same run on more devices (or compiled) is the same run, and a run may resume on other
hardware. Precision stays part of the id (bf16 arithmetic changes results beyond rounding), and so
do log_every / checkpoint_every / val_every (they shape what the run records)."""


def check_streams_split(field: str, streams: int, processes: int, accumulate: int = 1) -> None:
    """Every process (and each of its micro-batches) gets the same number of streams, or a one-line
    error."""
    groups = processes * accumulate
    if streams % groups:
        detail = f"{processes} processes" + (
            f" x {accumulate} micro-batches (train.accumulate)" if accumulate > 1 else ""
        )
        reject(
            field,
            f"{streams} streams do not split evenly over {detail}; use a multiple of {groups}",
        )
