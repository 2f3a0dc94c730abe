"""``TrainConfig``'s flags for the optimization: epochs and batch, the optimizer and its LR schedule,
accumulation and clipping, precision, activation checkpointing and compiling (``TrainingFlags``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_jobs.core.flags import flag_doc
from ray_jobs.core.lr_schedule import LR_SCHEDULES

OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class TrainingFlags:
    """How the model is trained (``--help`` section ``training``)."""

    epochs: int = field(default=3, metadata=flag_doc("passes over the data", "training"))
    batch_size: int = field(default=32, metadata=flag_doc("global batch size, split evenly across workers", "training"))
    lr: float = field(default=0.05, metadata=flag_doc("learning rate (the peak, with a schedule)", "training"))
    lr_schedule: str = field(
        default="constant",
        metadata=flag_doc(
            "the LR over the run's optimizer steps, after --warmup-steps: constant --lr, or cosine or linear "
            "decay from --lr to --min-lr (nanoGPT's formula; README: The training contract)",
            "training",
            choices=LR_SCHEDULES,
        ),
    )
    warmup_steps: int = field(
        default=0, metadata=flag_doc("optimizer steps of linear warmup to --lr: lr (s+1)/W at step s", "training")
    )
    min_lr: float = field(default=0.0, metadata=flag_doc("the LR that cosine and linear decay reach", "training"))
    grad_accum_steps: int = field(
        default=1,
        metadata=flag_doc(
            "each worker's share of a global batch in this many consecutive micro-steps, gradients summed: one "
            "optimizer step and one all-reduce per global batch, less activation memory (the pipeline "
            "accumulates over --num-microbatches instead)",
            "training",
        ),
    )
    grad_clip_norm: float | None = field(
        default=None,
        metadata=flag_doc(
            "clip the whole model's gradient norm (over every worker and stage) to this before each optimizer "
            "step, as clip_grad_norm_ does on one process",
            "training",
            "no clip",
        ),
    )
    optimizer: str = field(default="sgd", metadata=flag_doc("optimizer", "training", choices=OPTIMIZERS))
    momentum: float = field(default=0.0, metadata=flag_doc("SGD momentum", "training"))
    weight_decay: float = field(default=0.0, metadata=flag_doc("weight decay (sgd and adamw)", "training"))
    seed: int = field(default=0, metadata=flag_doc("seeds initial weights and the epoch shuffles", "training"))
    shuffle: bool = field(
        default=True, metadata=flag_doc("visit rows in file order instead of a seeded shuffle", "training", "shuffled")
    )
    precision: str = field(
        default="fp32",
        metadata=flag_doc(
            "autocast dtype of the forward and loss; weights, gradients and optimizer state stay float32 "
            "(fp16: GPUs only, with a gradient scaler)",
            "training",
            choices=PRECISIONS,
        ),
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata=flag_doc(
            "recompute each top-level block's forward in backward instead of keeping its activations "
            "(torch.utils.checkpoint, non-reentrant, dropout's RNG kept): less activation memory, one more forward "
            "per block, the same weights (ddp, dp, fsdp, and each pipeline stage)",
            "training",
        ),
    )
    peak_tflops: float | None = field(
        default=None,
        metadata=flag_doc(
            "one GPU's peak TFLOPS at --precision, for a language model's MFU in the summary",
            "training",
            "the known GPUs' data-sheet figures; none on CPU",
        ),
    )
    compile: bool = field(
        default=False,
        metadata=flag_doc(
            "torch.compile each block's forward (the gpt's blocks, a Hugging Face model's decoder layers, another "
            "model's top-level children) in every worker and stage; the first epoch's first steps compile (the "
            "bench reports that time apart from steady throughput); the same checkpoints and outputs, weights "
            "within float tolerance of eager's (inductor on CPU needs a C compiler)",
            "training",
        ),
    )
    count_comm_bytes: bool = field(
        default=False,
        metadata=flag_doc(
            "count the bytes each process hands to collectives and point-to-point calls per optimizer step, "
            "by kind (all-reduce, all-gather, reduce-scatter, send, receive), into the summary",
            "training",
        ),
    )
