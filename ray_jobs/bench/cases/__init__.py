"""What the bench measures, one module per case. A case is a function of the bench run (``Bench``:
its suite, data files and log) and of the results of the cases run before it; it returns its
section of ``bench.json``. A new case is a module here and an entry in ``CASES``, plus its section
in a ``report_<case>.py`` (added to ``report.render``) and any target in ``stats.targets``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray_jobs.bench.cases.accumulation import accumulation_case
from ray_jobs.bench.cases.checkpoint import checkpoint_case
from ray_jobs.bench.cases.comm_model import comm_model_case
from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.cases.data_parallel import data_parallel_cases
from ray_jobs.bench.cases.gpu import GPU_CASES as DATA_PARALLEL_GPU_CASES
from ray_jobs.bench.cases.gpu_lm import gpu_lm_case
from ray_jobs.bench.cases.ingest import ingest_case
from ray_jobs.bench.cases.layouts import layouts_case
from ray_jobs.bench.cases.lm import lm_case
from ray_jobs.bench.cases.pipeline import pipeline_case
from ray_jobs.bench.cases.pretrained import pretrained_case
from ray_jobs.bench.cases.sharding import sharding_case
from ray_jobs.bench.cases.stage_memory import stage_memory_case
from ray_jobs.bench.cases.stream_ingest import stream_ingest_case
from ray_jobs.bench.cases.tokenize import tokenize_case

GPU_CASES = {**DATA_PARALLEL_GPU_CASES, "gpu_lm": gpu_lm_case}

# The names ``--cases`` takes, in the order the cases run.
CASES: dict[str, Callable[[Bench, dict[str, Any]], dict[str, Any]]] = {
    "data_parallel": data_parallel_cases,
    "pipeline": pipeline_case,
    "ingest": ingest_case,  # after data_parallel: it compares with the DDP job's consumption
    "stage_memory": stage_memory_case,
    "stream_ingest": stream_ingest_case,
    "accumulation": accumulation_case,
    "lm": lm_case,
    "sharding": sharding_case,
    "pretrained": pretrained_case,
    "layouts": layouts_case,
    "checkpoint": checkpoint_case,
    "tokenize": tokenize_case,
    "comm_model": comm_model_case,  # computed: measures nothing
    **GPU_CASES,  # --suite gpu's
}


def suite_cases(suite: str) -> list[str]:
    """The cases a suite runs unless ``--cases`` says otherwise: the GPU suite its GPU cases, the
    others every other case."""
    return [name for name in CASES if (name in GPU_CASES) == (suite == "gpu")]
