"""DistributedDataParallel on Ray Train: ``python -m ray_jobs.ddp --num-workers N ...``.

Each worker is a process with its own model replica; ``TorchTrainer`` starts and places the
workers and sets up the process group (gloo on CPU, nccl on GPU); gradients are all-reduced.
"""

from __future__ import annotations

from ray_jobs.core.config import WorkerScaling
from ray_jobs.data_parallel.ddp import run
from ray_jobs.driver.entry import entry_point, exit_process


def main(argv: list[str] | None = None) -> int:
    return entry_point("ddp", WorkerScaling, run, argv, __doc__)


if __name__ == "__main__":
    exit_process(main())
