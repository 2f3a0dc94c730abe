"""The bench's suites: each a DDP and a pipeline workload (a model and a synthetic dataset), and how
many repetitions and configurations of each case it runs."""

from __future__ import annotations

from dataclasses import dataclass

from ray_jobs.core.config import TrainConfig


class Epochs:
    """An epoch of a workload with ``rows`` rows in global batches of ``batch_size``: full batches only."""

    rows: int
    batch_size: int

    @property
    def steps_per_epoch(self) -> int:
        return self.rows // self.batch_size

    @property
    def samples_per_epoch(self) -> int:
        return self.steps_per_epoch * self.batch_size


@dataclass(frozen=True)
class Workload(Epochs):
    """A model and a synthetic regression dataset (written as Parquet, read back like --data)."""

    model: str
    hidden: int
    depth: int
    rows: int
    in_features: int
    out_features: int
    batch_size: int
    epochs: int

    def config(self, data: str, storage_path: str, name: str) -> TrainConfig:
        # Checkpoint once, at the end: checkpoints are outside the timed loop, but not outside
        # the wall time that start-up cost is derived from.
        return TrainConfig(
            model=self.model,
            hidden=self.hidden,
            depth=self.depth,
            data=data,
            epochs=self.epochs,
            batch_size=self.batch_size,
            checkpoint_every=self.epochs,
            num_checkpoints_to_keep=1,
            storage_path=storage_path,
            name=name,
        )


@dataclass(frozen=True)
class LmWorkload(Epochs):
    """The built-in ``gpt`` on byte tokens of the standard library's own sources (``--task lm``):
    ``rows`` rows of ``block_size + 1`` consecutive tokens, written as Parquet like tokenized text."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    """T: tokens per input row, and the gpt's context length (its ``block_size`` default)."""
    rows: int
    batch_size: int
    epochs: int
    vocab_size: int = 257  # the byte tokenizer's: 256 byte values and end-of-text
    model: str = "gpt"

    def config(self, data: str, storage_path: str, name: str) -> TrainConfig:
        return TrainConfig(
            model=self.model,
            model_option=[f"n_layer={self.n_layer}", f"n_head={self.n_head}", f"n_embd={self.n_embd}"],
            task="lm",
            data=data,
            epochs=self.epochs,
            batch_size=self.batch_size,
            checkpoint_every=self.epochs,
            num_checkpoints_to_keep=1,
            storage_path=storage_path,
            name=name,
        )


@dataclass(frozen=True)
class GPTShape:
    """The activation-memory case's GPT (``--model gpt``) and the token batch it runs on."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    batch_size: int


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    ddp: Workload
    pipeline: Workload
    fit_repetitions: int
    """Repetitions of each Ray Train fit (DDP, DataParallel): ~15 s of fixed cost each."""
    overhead_repetitions: int
    """Repetitions of the DDP-overhead pair (raypar DDP and the torch peer), the headline ratio."""
    cheap_repetitions: int
    """Repetitions of the plain-torch peers and of ingest (seconds each)."""
    pipeline_repetitions: int
    """Runs of each pipeline configuration."""
    pipeline_target_repetitions: int
    """Runs of the configurations the targets judge (M = ``target_microbatches``): with both
    cores computing, Ray's own processes preempt a stage now and then, so runs differ more than
    the epochs within one run."""
    ddp_workers: int
    """Workers of the DDP-overhead and DataParallel-vs-DDP cases (capped by the cluster's CPUs)."""
    max_workers: int
    """Largest worker count of the scaling case (capped by the cluster's CPUs)."""
    num_stages: int
    microbatches: tuple[int, ...]
    target_microbatches: int
    """M of the pipeline targets, and of the transport comparison."""
    other_transport_schedules: tuple[str, ...]
    """Schedules also run over the other transports (compiled graph, plain actor calls), at every M
    of ``other_transport_microbatches``."""
    other_transport_microbatches: tuple[int, ...]
    ingest_repetitions: int
    memory: Workload
    """The stage-memory case's model, fixed while the stage count grows."""
    memory_stages: tuple[int, ...]
    stream: Workload
    """The streaming case's model and its large dataset (``rows``; the small one has 1/16)."""
    accum: Workload
    """The accumulation case's model: wide layers and a large global batch, so that what a worker
    holds for backward (activations) outweighs its weights; its global batch divides by 4 per worker."""
    lm: LmWorkload
    """The language-model case's gpt and tokens: DDP against the plain peer, and the pipeline
    (``num_stages``, ``target_microbatches``) against the sequential schedule; its global batch
    divides by ``ddp_workers`` and by ``target_microbatches``."""
    lm_repetitions: int
    """Runs of each side of the language-model case (each run's epochs after the first are its repetitions)."""
    lm_ddp_pairs: int = 5
    """Runs of its DDP pair (raypar and the torch peer, alternating): its goal asks for the median of 5."""
    lm_compile: bool = True
    """Whether the language-model case also runs raypar DDP with ``--compile`` (inductor: ~30 s to compile here)."""
    warm_ups: bool = True
    """Whether the DDP and pipeline cases first run once unmeasured (imports, worker processes):
    figures the suite compares need them; the smoke suite's mean nothing."""
    gpt: GPTShape = GPTShape(n_layer=6, n_head=4, n_embd=256, block_size=256, vocab_size=512, batch_size=8)
    pretrained: GPTShape | None = GPTShape(
        n_layer=12, n_head=12, n_embd=768, block_size=8, vocab_size=50257, batch_size=4
    )
    """The pretrained case's Hugging Face GPT-2 (default: GPT-2 small's 124M parameters, ~500 MB in
    fp32), written locally from its config: each worker's memory at start, ddp against fsdp. None:
    not run (the smoke suite: a tiny checkpoint shows nothing of memory)."""
    """The sharding case's GPT: activation memory with and without --activation-checkpointing."""
    # 16 rows of 128 tokens per worker and step: at width 256 a step's compute (~0.55 s on one thread
    # here) outweighs its collectives, as on a GPU at scale; at width 64 they weigh most.
    sharding: LmWorkload = LmWorkload(
        n_layer=6, n_head=4, n_embd=256, block_size=128, rows=256, batch_size=32, epochs=4
    )
    """The sharding case's gpt: FSDP beside DDP on 2 workers, AdamW, at each of ``sharding_widths``
    (widest last: its figures are the case's, judged against the target)."""
    sharding_widths: tuple[int, ...] = (64, 128, 256)
    # GPT-2 small's shape (12 x 768, T = 1024) on byte tokens: 85M parameters; 16 rows a step per GPU.
    gpu_lm: LmWorkload = LmWorkload(
        n_layer=12, n_head=12, n_embd=768, block_size=1024, rows=1024, batch_size=16, epochs=3
    )
    """The GPU lm case's gpt (``--suite gpu``): tokens/s and MFU in bf16, ddp, its torch peer and fsdp;
    ``rows`` and ``batch_size`` per GPU (the case multiplies them by the GPU count)."""
    checkpoint: Workload | None = Workload(
        "mlp", 2048, 9, rows=1024, in_features=8, out_features=8, batch_size=32, epochs=4
    )
    """The checkpoint case's model: its training state (weights and SGD's momentum) past 200 MB, a
    checkpoint each epoch, sync against async. An epoch (32 steps) outlasts an upload, as a real
    run's checkpoint interval does: an async checkpoint waits for the last one's upload first."""
    tokenize_bytes: int = 16_000_000
    """The tokenize case's corpus: about this many bytes of the standard library's sources (all
    of them, ~13 MB on this machine, when fewer), in files of ``TOKENIZE_FILE_BYTES``."""


SUITES: dict[str, Suite] = {
    "quick": Suite(
        name="quick",
        description="a few minutes on a 2-core machine",
        # 256 rows per worker and step: enough compute that gloo's all-reduce does not dominate.
        ddp=Workload("mlp", 256, 4, rows=32768, in_features=32, out_features=8, batch_size=512, epochs=5),
        pipeline=Workload("mlp", 1024, 8, rows=2048, in_features=1024, out_features=1024, batch_size=256, epochs=3),
        # Each run's epochs after the first are its repetitions: one Ray Train fit costs ~15 s of
        # start-up here, so repeating runs is kept for the start-up figure.
        fit_repetitions=1,
        overhead_repetitions=2,
        cheap_repetitions=3,
        pipeline_repetitions=1,
        pipeline_target_repetitions=3,
        ddp_workers=2,
        max_workers=2,
        num_stages=2,
        microbatches=(1, 2, 4, 8, 16),
        target_microbatches=8,
        other_transport_schedules=("gpipe",),
        other_transport_microbatches=(8,),
        ingest_repetitions=5,
        # 8 x 2048^2 weights, 134 MiB (with their gradients, 268 MiB): each stage's share stands
        # out against the ~320 MiB every process holds for torch and pyarrow alone.
        memory=Workload("mlp", 2048, 8, rows=256, in_features=1024, out_features=1024, batch_size=64, epochs=1),
        memory_stages=(1, 2, 4),
        # 3.8M rows of 64 + 4 floats: 1.0 GiB of Parquet (random floats barely compress).
        stream=Workload("mlp", 64, 2, rows=3_800_000, in_features=64, out_features=4, batch_size=1024, epochs=1),
        # 8,192 rows per worker and step through 1,024-wide layers: 99 MiB of activations saved for
        # backward at K=1 (25 MiB at K=4) against 8 MiB of weights, so the saving shows in peak RSS.
        accum=Workload("mlp", 1024, 4, rows=65536, in_features=64, out_features=16, batch_size=16384, epochs=4),
        # 0.86M parameters, ~5 MFLOPs a token: one step of 32 rows x 64 tokens per worker takes ~0.25 s
        # on one thread here, against ~10 ms for gloo's all-reduce of its 3.4 MiB of gradients.
        lm=LmWorkload(n_layer=4, n_head=4, n_embd=128, block_size=64, rows=512, batch_size=64, epochs=4),
        lm_repetitions=2,
    ),
    "full": Suite(
        name="full",
        description="a real cluster: more data, workers up to the cluster's CPUs, 5 repetitions",
        ddp=Workload("mlp", 1024, 4, rows=65536, in_features=256, out_features=16, batch_size=512, epochs=5),
        pipeline=Workload("mlp", 1024, 8, rows=8192, in_features=1024, out_features=1024, batch_size=256, epochs=5),
        fit_repetitions=5,
        overhead_repetitions=5,
        cheap_repetitions=5,
        pipeline_repetitions=5,
        pipeline_target_repetitions=5,
        ddp_workers=4,
        max_workers=64,
        num_stages=2,
        microbatches=(1, 2, 4, 8, 16),
        target_microbatches=8,
        other_transport_schedules=("gpipe", "1f1b", "sequential"),
        other_transport_microbatches=(1, 2, 4, 8, 16),
        ingest_repetitions=10,
        memory=Workload("mlp", 4096, 8, rows=512, in_features=1024, out_features=1024, batch_size=64, epochs=1),
        memory_stages=(1, 2, 4, 8),
        stream=Workload("mlp", 256, 2, rows=3_800_000, in_features=64, out_features=4, batch_size=1024, epochs=2),
        accum=Workload("mlp", 2048, 4, rows=131072, in_features=64, out_features=16, batch_size=32768, epochs=5),
        lm=LmWorkload(n_layer=8, n_head=8, n_embd=256, block_size=128, rows=2048, batch_size=128, epochs=4),
        lm_repetitions=5,
    ),
    "gpu": Suite(
        name="gpu",
        description="a machine with CUDA GPUs: DDP, DataParallel, fp32 vs bf16 and the pipeline beside plain "
        "PyTorch on the same GPUs",
        # The compute-bound MLP of issue #22 (256 -> 2048 x6 -> 16, batch 4096): ~430k samples/s in
        # fp32 on one H200 (2026-12-04), so each 131,072-row epoch lasts ~0.3 s.
        ddp=Workload("mlp", 2048, 7, rows=131072, in_features=256, out_features=16, batch_size=4096, epochs=6),
        pipeline=Workload("mlp", 4096, 8, rows=16384, in_features=1024, out_features=1024, batch_size=1024, epochs=4),
        # Two runs a side (each run's epochs after the first are its repetitions): a Ray Train fit
        # took ~45 s on that machine, so the suite's ~25 runs fit in about 12 minutes on one GPU.
        fit_repetitions=2,
        overhead_repetitions=2,
        cheap_repetitions=2,
        pipeline_repetitions=2,
        pipeline_target_repetitions=2,
        ddp_workers=8,
        max_workers=8,
        num_stages=2,
        microbatches=(8,),
        target_microbatches=8,
        other_transport_schedules=(),
        other_transport_microbatches=(),
        ingest_repetitions=1,
        memory=Workload("mlp", 64, 4, rows=128, in_features=64, out_features=64, batch_size=32, epochs=1),
        memory_stages=(1,),
        stream=Workload("mlp", 16, 2, rows=32768, in_features=8, out_features=2, batch_size=256, epochs=1),
        accum=Workload("mlp", 64, 2, rows=1024, in_features=8, out_features=2, batch_size=256, epochs=1),
        lm=LmWorkload(n_layer=2, n_head=2, n_embd=32, block_size=16, rows=128, batch_size=64, epochs=1),  # not run
        lm_repetitions=1,
        lm_ddp_pairs=1,
    ),
    "smoke": Suite(
        name="smoke",
        description="seconds-scale check that the bench itself runs; its numbers mean nothing",
        ddp=Workload("mlp", 32, 3, rows=512, in_features=8, out_features=4, batch_size=64, epochs=2),
        pipeline=Workload("mlp", 64, 4, rows=256, in_features=64, out_features=64, batch_size=64, epochs=2),
        fit_repetitions=1,
        overhead_repetitions=1,
        cheap_repetitions=1,
        pipeline_repetitions=1,
        pipeline_target_repetitions=1,
        ddp_workers=2,
        max_workers=2,
        num_stages=2,
        microbatches=(1, 4),
        target_microbatches=4,
        other_transport_schedules=("gpipe",),
        other_transport_microbatches=(4,),
        ingest_repetitions=2,
        memory=Workload("mlp", 64, 4, rows=128, in_features=64, out_features=64, batch_size=32, epochs=1),
        memory_stages=(1, 2),
        stream=Workload("mlp", 16, 2, rows=8192, in_features=8, out_features=2, batch_size=256, epochs=1),
        accum=Workload("mlp", 32, 3, rows=512, in_features=8, out_features=4, batch_size=64, epochs=2),
        lm=LmWorkload(n_layer=2, n_head=2, n_embd=32, block_size=16, rows=128, batch_size=16, epochs=2),
        lm_repetitions=1,
        lm_ddp_pairs=1,
        lm_compile=False,  # the Ray tests train compiled blocks; its figures are compile_figures' (unit-tested)
        warm_ups=False,
        gpt=GPTShape(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, batch_size=4),
        sharding=LmWorkload(n_layer=2, n_head=2, n_embd=32, block_size=16, rows=64, batch_size=16, epochs=2),
        sharding_widths=(32,),
        pretrained=None,
        checkpoint=Workload("mlp", 64, 3, rows=64, in_features=8, out_features=8, batch_size=32, epochs=3),
        tokenize_bytes=400_000,
    ),
}

PIPELINE_SCHEDULES = ("sequential", "gpipe", "1f1b")
PIPELINE_TRANSPORT = "p2p"  # raypar's default (auto); the sweep's transport
OTHER_TRANSPORTS = ("compiled", "actor_calls")  # compared with it at a few configurations
