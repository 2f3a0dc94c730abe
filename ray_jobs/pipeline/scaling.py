"""The pipeline's flags (``PipelineScaling``): how many stages and micro-batches, the schedule,
the transport, each stage's resources and where they are placed, and how the model is cut;
checked on the driver before Ray is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models import build_model, is_user_model, split_into_stages
from ray_jobs.core.config import (
    PLACEMENT_STRATEGIES,
    TrainConfig,
    flag_doc,
    require,
    require_choice,
    require_divisible,
    require_gpu_for_fp16,
)
from ray_jobs.core.pretrained import is_pretrained
from ray_jobs.driver.prepare import PreparedRun
from ray_jobs.driver.resources import Request, gpu_sharing
from ray_jobs.pipeline.cut import StageCut, cut_stages, measured_unit_costs, meta_stages, shared_names
from ray_jobs.pipeline.replicas import STAGE_SHARDINGS
from ray_jobs.pipeline.schedules import SCHEDULES
from ray_jobs.pipeline.transports import TRANSPORTS

STAGE_BALANCES = ("params", "time")  # what --stage-balance evens out between the stages


@dataclass
class PipelineScaling:
    """How the model is cut and where its stages run."""

    num_stages: int = field(default=2, metadata=flag_doc("pipeline stages, one Ray actor (and GPU) each", "pipeline"))
    num_microbatches: int = field(
        default=4,
        metadata=flag_doc("micro-batches per global batch (per replica's share with --data-parallel)", "pipeline"),
    )
    data_parallel: int = field(
        default=1,
        metadata=flag_doc(
            "R replicas of the whole pipeline (R x S stage actors): each takes 1/R of every global batch, and each "
            "stage's gradients are averaged with its R-1 copies before every step (DP x PP, over p2p's gloo group)",
            "pipeline",
        ),
    )
    schedule: str = field(
        default="1f1b", metadata=flag_doc("micro-batch schedule", "pipeline", choices=sorted(SCHEDULES))
    )
    use_gpu: bool = field(
        default=False, metadata=flag_doc("give each stage GPUs (--gpus-per-stage)", default_text="CPU")
    )
    gpus_per_stage: float = field(
        default=1.0,
        metadata=flag_doc(
            "GPUs per stage with --use-gpu; a fraction lets small stages share one GPU (then over p2p or actor_calls, "
            "not nccl)"
        ),
    )
    cpus_per_stage: float = field(default=1.0, metadata=flag_doc("CPUs per stage actor; also its torch threads"))
    placement_strategy: str = field(
        default="PACK", metadata=flag_doc("PACK keeps neighbouring stages on one node", choices=PLACEMENT_STRATEGIES)
    )
    transport: str = field(
        default="auto",
        metadata=flag_doc(
            "p2p: torch.distributed (gloo) send/recv between the stages, one actor call per "
            "stage per --batches-per-call batches, tensors through host memory; compiled: a Ray Compiled Graph (nccl "
            "between GPUs); actor_calls: one actor call per op; auto: compiled for GPU stages on "
            "one node, else p2p",
            "pipeline",
            choices=TRANSPORTS,
        ),
    )

    batch_timeout_s: float = field(
        default=600.0, metadata=flag_doc("fail the run when one global batch takes longer than this (s)", "pipeline")
    )
    stage_balance: str = field(
        default="params",
        metadata=flag_doc(
            "how the model is cut: params balances the stages' parameter counts; time times each layer's "
            "forward and backward on the driver's CPU over one micro-batch and balances that, for layers whose "
            "compute is out of proportion to their parameters (convolutions)",
            "pipeline",
            choices=STAGE_BALANCES,
        ),
    )
    batches_per_call: int = field(
        default=8,
        metadata=flag_doc(
            "p2p: global batches per actor call; more removes the dispatch gap between batches, "
            "fewer lets Ctrl-C and the batch timeout act sooner (every batch still has its "
            "own loss and optimizer step)",
            "pipeline",
        ),
    )

    stage_sharding: str = field(
        default="none",
        metadata=flag_doc(
            "with --data-parallel R: fsdp fully_shards each stage over its R copies, so each actor holds 1/R of "
            "its stage's weights, gradients and optimizer state (FSDP x PP); none replicates the stages",
            "pipeline",
            choices=STAGE_SHARDINGS,
        ),
    )

    def __post_init__(self) -> None:
        require(self.batch_timeout_s > 0, "batch_timeout_s", self.batch_timeout_s, "positive")
        require(self.batches_per_call >= 1, "batches_per_call", self.batches_per_call, "at least 1")
        require_choice(self.transport, TRANSPORTS, "transport")
        require_choice(self.stage_balance, STAGE_BALANCES, "stage_balance")
        require(self.num_stages >= 1, "num_stages", self.num_stages, "at least 1")
        require(self.num_microbatches >= 1, "num_microbatches", self.num_microbatches, "at least 1")
        require(self.data_parallel >= 1, "data_parallel", self.data_parallel, "at least 1")
        require_choice(self.stage_sharding, STAGE_SHARDINGS, "stage_sharding")
        if self.stage_sharding == "fsdp" and self.data_parallel < 2:
            raise ValueError(
                "--stage-sharding fsdp shards each stage over its copies: it needs --data-parallel 2 or more"
            )
        if self.data_parallel > 1 and self.transport not in ("auto", "p2p"):
            raise ValueError(
                f"--data-parallel {self.data_parallel} needs --transport p2p, not {self.transport}: each stage "
                "averages its gradients with its copies over p2p's process group"
            )
        require(self.cpus_per_stage > 0, "cpus_per_stage", self.cpus_per_stage, "positive")
        require(self.gpus_per_stage > 0, "gpus_per_stage", self.gpus_per_stage, "positive")
        if self.gpus_per_stage != 1.0 and not self.use_gpu:
            raise ValueError("--gpus-per-stage needs --use-gpu")
        require_choice(self.schedule, sorted(SCHEDULES), "schedule")
        require_choice(self.placement_strategy, PLACEMENT_STRATEGIES, "placement_strategy")

    def check(self, cfg: TrainConfig) -> None:
        """Checks that need both configs, run before Ray is touched."""
        if self.data_parallel > 1:
            per_replica = self.data_parallel * self.num_microbatches
            if cfg.batch_size % per_replica:
                raise ValueError(
                    f"--batch-size {cfg.batch_size} must divide into --data-parallel {self.data_parallel} shares of "
                    f"--num-microbatches {self.num_microbatches} equal micro-batches (a multiple of {per_replica}): "
                    "unequal shares would weigh rows unequally in the replicas' average"
                )
        require_divisible(cfg.batch_size, self.num_microbatches, "--num-microbatches")
        require_gpu_for_fp16(cfg, self.use_gpu, "--use-gpu")
        if cfg.grad_accum_steps > 1:
            raise ValueError(
                f"--grad-accum-steps applies to ddp and dp: the pipeline already accumulates over its "
                f"micro-batches; use --num-microbatches {self.num_microbatches * cfg.grad_accum_steps} for the "
                "same global batch in smaller pieces"
            )
        if cfg.grad_clip_norm is not None and self.transport not in ("auto", "p2p"):
            raise ValueError(
                f"--grad-clip-norm on the pipeline needs --transport p2p, not {self.transport}: the stages sum "
                "their gradients' squared norms over p2p's process group"
            )
        if self.stage_sharding == "fsdp" and cfg.precision == "fp16":
            raise ValueError("--stage-sharding fsdp runs fp32 or bf16: use --precision bf16, or --stage-sharding none")
        if cfg.grad_clip_norm is not None and cfg.precision == "fp16":
            raise ValueError(
                "--grad-clip-norm with --precision fp16 runs on ddp and dp; the pipeline does not clip fp16 yet"
            )
        if cfg.precision == "fp16" and self.transport not in ("auto", "p2p"):
            raise ValueError(
                f"--precision fp16 on the pipeline needs --transport p2p, not {self.transport}: its "
                "stages skip an overflowing step together by agreeing over p2p's process group"
            )
        shared = self.shared_gpus
        if shared and self.transport == "compiled":
            raise ValueError(
                f"--transport compiled cannot connect stages that share a GPU ({shared}; nccl "
                "refuses two ranks on one device): use --transport p2p or actor_calls, or "
                "--gpus-per-stage 1"
            )
        # A registered model's layer count does not depend on the data's widths, so any widths tell
        # whether S fits; a user's model may need its real widths: it is cut once the data is read.
        if not is_user_model(cfg.model) and not is_pretrained(cfg.model):
            split_into_stages(build_model(cfg.model, 1, 1, **cfg.model_options), self.num_stages)

    def check_model(self, prepared: PreparedRun) -> None:
        """Cut the model (on the meta device) with the data's widths."""
        stages = meta_stages(prepared.cfg, prepared.dataset, self.num_stages, prepared.model_factory)
        shared = shared_names(stages)
        if shared and self.stage_sharding == "fsdp":
            raise ValueError(
                f"--stage-sharding fsdp cannot shard this cut: {' and '.join(shared)} are one weight held by two "
                "stages (a tied embedding and head), whose gradients the stages sum whole; use --stage-sharding none"
            )
        if shared and self.transport not in ("auto", "p2p"):
            raise ValueError(
                f"--transport {self.transport} cannot train this cut: {' and '.join(shared)} are one weight held by "
                "two stages (a tied embedding and head), whose gradients the stages sum over p2p's process "
                "group; use --transport p2p, or --num-stages 1"
            )

    def cut(self, prepared: PreparedRun) -> StageCut:
        """How the run's model is cut, by ``--stage-balance``; said on one line when measured."""
        cfg, dataset, factory = prepared.cfg, prepared.dataset, prepared.model_factory
        if self.stage_balance == "params":
            return cut_stages(cfg, dataset, self.num_stages, factory)
        seconds = measured_unit_costs(
            cfg, dataset, prepared.initial_state, self.num_microbatches, max(1, int(self.cpus_per_stage)), factory
        )
        cut = cut_stages(cfg, dataset, self.num_stages, factory, seconds)
        by_params = cut_stages(cfg, dataset, self.num_stages, factory)
        print(
            f"[raypar] --stage-balance time: stages of children {' | '.join(map(' '.join, cut.children))}; "
            f"measured {_stage_ms(cut, seconds)} ms per micro-batch and stage "
            f"(cut by parameters: {_stage_ms(by_params, seconds)})",
            flush=True,
        )
        return cut

    @property
    def gpus_each(self) -> float | None:
        return self.gpus_per_stage if self.use_gpu else None

    @property
    def shared_gpus(self) -> str | None:
        """Why two stages may share a GPU (``devices.gpu_sharing``), or None."""
        return gpu_sharing(self.num_actors, self.gpus_each, what=self.count_flags, flag="--gpus-per-stage")

    @property
    def num_actors(self) -> int:
        """Stage actors in all: S per replica."""
        return self.num_stages * self.data_parallel

    @property
    def count_flags(self) -> str:
        """The flags that set ``num_actors``, for messages."""
        return "--num-stages" if self.data_parallel == 1 else "--num-stages x --data-parallel"

    @property
    def request(self) -> Request:
        """What the run asks Ray to place, for its refusals."""
        label = ""
        if self.data_parallel > 1:
            grid = f"--num-stages {self.num_stages} x --data-parallel {self.data_parallel}"
            label = f"{self.num_actors} stage actors ({grid})"
        resources = {"CPU": "--cpus-per-stage", "GPU": "--gpus-per-stage"}
        return Request(self.count_flags, self.num_actors, resources, label)

    @property
    def bundles(self) -> list[dict[str, float]]:
        """One bundle per stage actor, in ``bundle_index`` order."""
        bundle = {"CPU": self.cpus_per_stage, **({"GPU": self.gpus_per_stage} if self.use_gpu else {})}
        return [dict(bundle) for _ in range(self.num_actors)]

    def bundle_index(self, replica: int, stage: int) -> int:
        """Bundles are listed stage by stage, a stage's R replicas side by side, so that PACK
        (which fills a node before the next, in bundle order) puts a stage's copies on one node
        while they fit: their gradient all-reduce, a whole stage's weights each step, then stays
        on the node's links, and only the activations between stages cross nodes (data innermost,
        as DeepSpeed's PipeDataParallelTopology lays it out)."""
        return stage * self.data_parallel + replica


def _stage_ms(cut: StageCut, unit_seconds: list[float]) -> str:
    bounds = [sum(cut.num_units[:k]) for k in range(len(cut.num_units) + 1)]
    return ", ".join(f"{1000 * sum(unit_seconds[a:b]):.2f}" for a, b in zip(bounds, bounds[1:]))
