"""The DataParallel baseline on Ray Train: one worker holds every GPU of its node and
``nn.DataParallel`` scatters each batch over them with threads in one process. Simple,
single-node, and limited by the GIL and by scatter/gather on GPU 0: kept as the baseline DDP is
measured against. Runs on the driver; the worker runs ``worker.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_jobs.core.config import (
    TrainConfig,
    WorkerScaling,
    flag_doc,
    require,
    require_accumulation_fits,
    require_gpu_for_fp16,
)
from ray_jobs.data_parallel.trainer import run_workers
from ray_jobs.data_parallel.wrap import Replicas, wrap_dp
from ray_jobs.driver.prepare import PreparedRun
from ray_jobs.driver.summary import TrainSummary
from ray_jobs.testing.faults import NO_FAULTS, Faults


@dataclass
class DataParallelScaling:
    """The one worker of a DataParallel run."""

    gpus: int = field(default=0, metadata=flag_doc("GPUs the worker holds, all on one node (0: CPU)"))
    cpus_per_worker: float = field(
        default=1.0, metadata=flag_doc("CPUs reserved for the worker; also its torch threads")
    )

    def __post_init__(self) -> None:
        require(self.gpus >= 0, "gpus", self.gpus, "zero or more")
        require(self.cpus_per_worker > 0, "cpus_per_worker", self.cpus_per_worker, "positive")

    def check(self, cfg: TrainConfig) -> None:
        """One worker takes the whole global batch, so any batch size works."""
        require_gpu_for_fp16(cfg, self.gpus > 0, "--gpus")
        require_accumulation_fits(cfg, 1)
        if cfg.compile and self.gpus > 1:
            raise ValueError(
                "--compile with dp on more than one GPU: DataParallel copies the model onto each GPU at every "
                "forward, and each block's compiled forward stays bound to the first copy; use ddp"
            )

    def workers(self) -> WorkerScaling:
        gpus = float(self.gpus) if self.gpus else None
        return WorkerScaling(1, self.gpus > 0, self.cpus_per_worker, gpus, "PACK")


def run(prepared: PreparedRun, scaling: DataParallelScaling, faults: Faults = NO_FAULTS) -> TrainSummary:
    return run_workers(prepared, scaling.workers(), Replicas(wrap_dp), faults)
