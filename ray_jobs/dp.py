"""The DataParallel baseline: ``python -m ray_jobs.dp --gpus G ...``.

One Ray Train worker holds every GPU of its node; ``nn.DataParallel`` scatters each batch over
them with threads in one process. Simple, single-node, and limited by the GIL and by
scatter/gather on GPU 0: kept as the baseline DDP is measured against.
"""

from __future__ import annotations

from ray_jobs.data_parallel.dp import DataParallelScaling, run
from ray_jobs.driver.entry import entry_point, exit_process


def main(argv: list[str] | None = None) -> int:
    return entry_point("dp", DataParallelScaling, run, argv, __doc__)


if __name__ == "__main__":
    exit_process(main())
