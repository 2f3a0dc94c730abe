"""A job entry point with the tests' fault injection, for tests whose job must be its own process
(a driver of another cluster than the session's): ``python -m tests.fault_driver STRATEGY FAULTS
-- FLAGS...``, FAULTS a JSON object of the strategy's fault keywords."""

from __future__ import annotations

import json
import sys

from ray_jobs import ddp
from ray_jobs.core.config import WorkerScaling
from ray_jobs.data_parallel import fsdp
from ray_jobs.driver.entry import entry_point, exit_process
from ray_jobs.pipeline import trainer as pipeline
from ray_jobs.testing.faults import Faults

STRATEGIES = {
    "ddp": (ddp, WorkerScaling),
    "fsdp": (fsdp, fsdp.ShardedScaling),
    "pipeline": (pipeline, pipeline.PipelineScaling),
}


def main(argv: list[str]) -> int:
    strategy, armed, flags = argv[0], json.loads(argv[1]), argv[2:]
    faults = Faults(**{**armed, "holds": tuple(tuple(pair) for pair in armed.get("holds", ()))})
    module, scaling_cls = STRATEGIES[strategy]
    return entry_point(
        strategy, scaling_cls, lambda prepared, scaling: module.run(prepared, scaling, faults), flags, None
    )


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
