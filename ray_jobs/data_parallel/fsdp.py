"""Fully sharded data parallel (FSDP2) on Ray Train: the DDP run (same workers, placement, process
group, loop, checkpoints and outputs), with each worker holding 1/N of the weights, gradients and
optimizer state (``sharding.Shards``). Runs on the driver; the workers run ``worker.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ray_jobs.core.config import TrainConfig, WorkerScaling, flag_doc, require
from ray_jobs.core.model_init import warn_not_reproducible
from ray_jobs.data_parallel.sharding import Shards
from ray_jobs.data_parallel.trainer import run_workers
from ray_jobs.driver.prepare import PreparedRun
from ray_jobs.driver.summary import TrainSummary
from ray_jobs.testing.faults import NO_FAULTS, Faults


@dataclass
class ShardedScaling(WorkerScaling):
    """DDP's placement, and how FSDP shards."""

    reshard_after_forward: bool = field(
        default=True,
        metadata=flag_doc(
            "free each block's gathered weights after its forward and gather them again in backward (ZeRO-3's "
            "memory); --no-reshard-after-forward keeps them to backward: one all-gather less per block, the "
            "whole unsharded model held at the forward's end",
            default_text="on",
        ),
    )

    shard_group_size: int | None = field(
        default=None,
        metadata=flag_doc(
            "HSDP: shard each tensor over groups of this many workers and replicate it across the groups "
            "(FSDP2 on a 2-D mesh (replicate, shard)), so a step's all-gathers and reduce-scatters stay within "
            "a group and one all-reduce of the shards crosses groups; Ray Train numbers a node's workers "
            "consecutively, so a group that fits on a node is one (--placement-strategy PACK); must divide "
            "--num-workers, and every worker count of an elastic run",
            default_text="--num-workers: every worker, FSDP",
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shard_group_size is not None:
            require(self.shard_group_size >= 1, "shard_group_size", self.shard_group_size, "at least 1")

    def check(self, cfg: TrainConfig) -> None:
        super().check(cfg)
        group = self.shard_group_size
        counts = range(self.min_workers if self.elastic else self.num_workers, self.num_workers + 1)
        if group is not None and any(count % group for count in counts):
            sizes = ", ".join(str(count) for count in counts if count % group)
            raise ValueError(
                f"--shard-group-size {group} does not divide {sizes} worker(s): give a group size that divides "
                "--num-workers (and, for an elastic run, every count from --min-workers up)"
            )
        if cfg.precision == "fp16":
            raise ValueError(
                "--precision fp16 is not offered with fsdp: its gradient scaler would check each rank's own "
                "shard for overflow, so ranks could skip different steps; use --precision bf16"
            )


def run(prepared: PreparedRun, scaling: ShardedScaling, faults: Faults = NO_FAULTS) -> TrainSummary:
    synced = (nn.modules.batchnorm._BatchNorm,) if scaling.sync_batchnorm else ()
    warn_not_reproducible(prepared.cfg, prepared.dataset, prepared.model_factory, "FSDP", synced)
    shards = Shards(scaling.reshard_after_forward, scaling.sync_batchnorm, scaling.shard_group_size)
    return run_workers(prepared, scaling, shards, faults)
