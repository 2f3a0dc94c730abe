"""Fully sharded data parallel (FSDP2) on Ray Train: ``python -m ray_jobs.fsdp --num-workers N ...``.

DDP's run, with each worker holding 1/N of the weights, gradients and optimizer state: a block's
weights are all-gathered just before its forward and backward and freed after, its gradients
reduce-scattered. For models whose weights and optimizer state do not fit one GPU beside its
activations.
"""

from __future__ import annotations

from ray_jobs.data_parallel.fsdp import ShardedScaling, run
from ray_jobs.driver.entry import entry_point, exit_process


def main(argv: list[str] | None = None) -> int:
    return entry_point("fsdp", ShardedScaling, run, argv, __doc__)


if __name__ == "__main__":
    exit_process(main())
