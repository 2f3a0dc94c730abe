"""The stage-memory case: one model of fixed size cut into more and more stages, and what each
stage's process holds at its peak. A stage builds only its own layers (the whole model exists on
the meta device), so its share of the model should shrink as 1/S over a fixed per-process base."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any

from ray_jobs.bench.cases.common import Bench
from ray_jobs.driver.prepare import prepare

# Half a CPU per stage: S=4 fits the 2-core development machine. Memory does not depend on speed.
CPUS_PER_STAGE = 0.5


def stage_memory_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    from ray_jobs.pipeline import trainer as pipeline
    from ray_jobs.pipeline.cut import stage_keys

    work, rows = bench.suite.memory, []
    for num_stages in bench.suite.memory_stages:
        bench.log(f"[bench] stage memory: {num_stages} stage(s)")
        cfg = bench.config(work, bench.memory_data, f"memory-{num_stages}")
        prepared = prepare(cfg, "pipeline")
        scaling = pipeline.PipelineScaling(
            num_stages=num_stages, num_microbatches=max(num_stages, 2), cpus_per_stage=CPUS_PER_STAGE
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*the pipeline can never fill.*")
            summary = pipeline.run(prepared, scaling)
        bench.clean(prepared.run_dir)
        keys = stage_keys(cfg, prepared.dataset, num_stages)
        rows.append(
            {
                "num_stages": num_stages,
                "stage_parameter_bytes": [sum(_bytes(prepared.initial_state[k]) for k in own) for own in keys],
                "stage_peak_rss_bytes": summary.extra["stage_peak_rss_bytes"],
                "stage_peak_device_bytes": summary.extra["stage_peak_device_bytes"],
            }
        )
    return {"workload": asdict(work), "cpus_per_stage": CPUS_PER_STAGE, "rows": rows}


def _bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()
