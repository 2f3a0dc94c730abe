"""The central promise: every strategy and worker count trains the single-process reference model."""

from __future__ import annotations

import json
import time

import pytest

from ray_jobs.core.config import TrainConfig
from ray_jobs.core.lr_schedule import LRSchedule
from tests.helpers import assert_trains_the_reference, run_strategy

pytestmark = pytest.mark.ray

CASES = [
    # strategy, num_workers, task, shuffle, optimizer settings. ddp on 2 workers with momentum, a
    # cosine schedule, its warmup and floor, shuffled: tests/ray/test_clip.py's ddp case (with
    # --grad-accum-steps and a clip on top)
    # 32 rows over 3 workers: slices of 11, 11 and 10, each loss weighted by its share
    ("ddp", 3, "regression", False, {"batch_size": 32}),
    (
        "ddp",
        2,
        "classification",
        True,
        {"optimizer": "adamw", "lr": 0.01, "weight_decay": 0.01, "lr_schedule": "linear"},
    ),
    # each Linear recomputed in backward: the same weights (the pipeline's and fsdp's: tests/ray/test_fsdp.py)
    ("ddp", 2, "classification", False, {"activation_checkpointing": True}),
    # one worker: its own world, nothing all-reduced (the tasks, shuffling and optimizer settings
    # each also run above on more workers)
    ("ddp", 1, "regression", True, {"momentum": 0.5}),
    ("dp", 1, "classification", True, {"weight_decay": 0.001}),
]


@pytest.mark.parametrize(("strategy", "num_workers", "task", "shuffle", "optim"), CASES)
def test_matches_single_process_reference(ray_cluster, tmp_path, request, strategy, num_workers, task, shuffle, optim):
    data = request.getfixturevalue(f"{task}_data")
    cfg = TrainConfig(
        model="seed-mlp",
        hidden=8,
        data=data,
        epochs=3,
        seed=7,
        shuffle=shuffle,
        storage_path=str(tmp_path),
        name="run",
        **{"lr": 0.05, "batch_size": 16, **optim},
    )
    summary = run_strategy(strategy, cfg, num_workers)
    # Per-epoch losses are means over the same batches, averaged across workers by all-reduce.
    assert_trains_the_reference(summary, cfg)
    record = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert record["strategy"] == strategy
    assert record["world_size"] == num_workers
    assert record["epochs_completed"] == 3
    assert record["resumed_from_epoch"] is None
    assert record["world_sizes"] == [{"num_workers": num_workers, "epoch": 0, "step": 0}]
    assert len(record["worker_nodes"]) == num_workers
    assert record["samples_per_second"] > 0
    schedule = LRSchedule(cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr, 3 * (96 // cfg.batch_size))
    assert record["lr"] == schedule.readings()
    # the bench reads each epoch's CPU steal (None off Linux), the first step's wall-clock time
    # and every worker's peak RSS from here
    assert len(summary.extra["epoch_steal"]) == 3
    assert 0 < summary.extra["first_step_at"] <= time.time()
    rss = summary.extra["worker_peak_rss_bytes"]
    assert len(rss) == num_workers and min(rss) > 10 * 2**20  # a torch process is far above 10 MiB
