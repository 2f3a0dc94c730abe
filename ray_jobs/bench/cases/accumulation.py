"""The gradient-accumulation case: raypar DDP on one model, data and global batch with
``--grad-accum-steps`` 1 and 4, side by side: samples/s, each worker's peak RSS, and the bytes of
activations one worker's step holds for backward at its peak.

The throughput and the RSS come from the DDP fits. The activations are read in the bench's own
process, one worker's step replayed outside Ray: ``core.step.train_step`` (the function the
workers run) on that worker's share of a global batch, under ``core.activations.HeldForBackward``; it is
deterministic, where RSS also holds torch's, Ray's and the data's hundreds of MiB."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch

from models import build_model
from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.cases.data_parallel import max_workers, raypar_data_parallel
from ray_jobs.bench.stats import ratio, summarise
from ray_jobs.bench.suites import Workload
from ray_jobs.core.activations import HeldForBackward
from ray_jobs.core.step import build_optimizer, loss_function, train_step
from ray_jobs.data.parquet import synthesize, write_table

# K=1 first, then the K=4, in each repetition.
ACCUM_STEPS = (1, 4)


def accumulation_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    work = bench.suite.accum
    data = os.path.join(bench.out, "data", "accum.parquet")
    write_table(synthesize(work.rows, work.in_features, work.out_features, "regression", seed=0), data)
    num_workers = min(bench.suite.ddp_workers, max_workers())
    while num_workers > 1 and work.batch_size % (num_workers * max(ACCUM_STEPS)):
        num_workers -= 1  # the largest K must divide each worker's share of the batch
    raw: dict[int, list[dict]] = {k: [] for k in ACCUM_STEPS}
    for rep in range(bench.suite.fit_repetitions):
        for k in ACCUM_STEPS:
            bench.measure(
                raw[k],
                f"raypar DDP {num_workers} workers, --grad-accum-steps {k}",
                rep,
                lambda k=k: raypar_data_parallel(bench, "ddp", num_workers, work=work, data=data, grad_accum_steps=k),
            )
    os.remove(data)
    figures = {k: summarise(raw[k]) for k in ACCUM_STEPS}
    saved = {k: step_saved_bytes(work, num_workers, k) for k in ACCUM_STEPS}
    base, most = figures[ACCUM_STEPS[0]], figures[ACCUM_STEPS[-1]]
    return {
        "workload": asdict(work),
        "num_workers": num_workers,
        "rows_per_worker": work.batch_size // num_workers,
        "runs": [
            {
                "grad_accum_steps": k,
                "samples_per_second": figures[k]["samples_per_second"],
                "peak_rss_bytes": figures[k]["peak_rss_bytes"],
                "saved_activation_peak_bytes": saved[k],
            }
            for k in ACCUM_STEPS
        ],
        "samples_per_second_ratio": ratio(most["samples_per_second"], base["samples_per_second"]),
        "peak_rss_ratio": ratio(most["peak_rss_bytes"], base["peak_rss_bytes"]),
        "raw": {str(k): raw[k] for k in ACCUM_STEPS},
    }


def step_saved_bytes(work: Workload, num_workers: int, accum_steps: int) -> int:
    """Peak bytes one worker's optimizer step holds for backward (``HeldForBackward``): the
    model of ``work`` on a worker's share of the global batch (random rows: the bytes do not
    depend on the values), in ``accum_steps`` micro-steps, as ``train_step`` takes it."""
    cfg = work.config(data="", storage_path="", name="saved-activations")  # its optimizer
    torch.manual_seed(cfg.seed)
    model = build_model(work.model, work.in_features, work.out_features, hidden=work.hidden, depth=work.depth)
    rows = work.batch_size // num_workers
    x, y = torch.randn(rows, work.in_features), torch.randn(rows, work.out_features)
    with HeldForBackward(model).counting() as saved:
        train_step(
            model, build_optimizer(model.parameters(), cfg), loss_function("regression"), x, y, accum_steps=accum_steps
        )
    return saved.peak_bytes
