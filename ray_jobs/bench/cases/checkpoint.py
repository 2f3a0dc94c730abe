"""The checkpoint case: how long a checkpoint holds the training loop, ``--checkpoint-mode sync``
against ``async``, on ddp with 2 workers and a model whose training state (weights and SGD's
momentum) passes 200 MB, a checkpoint after every epoch, on the bench's storage (``--storage-path``:
a local folder by default, a bucket when given one).

Each run's stalls are measured inside world rank 0 (``CheckpointSaver.stalls_s``: from the
checkpoint's start to the report's return), every checkpoint but the run's last (which is always
written in sync, with the final weights).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.stats import ratio, stats
from ray_jobs.data.parquet import synthesize, write_table

MODES = ("sync", "async")
NUM_WORKERS = 2


def checkpoint_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    work = bench.suite.checkpoint
    if work is None:
        return {"skipped": "this suite has no checkpoint workload"}
    data = os.path.join(bench.out, "data", "checkpoint.parquet")
    write_table(synthesize(work.rows, work.in_features, work.out_features, "regression", seed=0), data)
    stalls: dict[str, list[float]] = {mode: [] for mode in MODES}
    state_bytes = 0
    for rep in range(bench.suite.fit_repetitions):
        for mode in MODES:  # interleaved: the machine's drift falls on both
            bench.log(f"[bench] checkpoint stall, --checkpoint-mode {mode} (repetition {rep + 1})")
            cfg = dataclasses.replace(
                bench.config(work, data, f"ckpt-{mode}"),
                checkpoint_every=1,
                checkpoint_mode=mode,
                momentum=0.9,
                num_checkpoints_to_keep=2,
            )
            summary = bench.fit_workers(cfg, "ddp", NUM_WORKERS)
            stalls[mode] += summary.extra["checkpoint_stall_s"] or []
            held = summary.extra["worker_model_state_bytes"][0]
            state_bytes = held["parameters"] + held["optimizer"]
    figures = {mode: stats(values) for mode, values in stalls.items()}
    return {
        "workload": dataclasses.asdict(work),
        "num_workers": NUM_WORKERS,
        "storage": "bucket" if "://" in bench.storage_path else "local",
        "training_state_bytes": state_bytes,
        "stall_s": figures,
        "async_over_sync": ratio(figures["async"], figures["sync"]),
    }
