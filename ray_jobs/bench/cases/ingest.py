"""The ingest case: Parquet to training batches in one Ray worker, against pyarrow alone and against
the DDP job's consumption."""

from __future__ import annotations

import os
import time
from typing import Any

import pyarrow.parquet as pq

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.peer import PEER_TIMEOUT_S
from ray_jobs.bench.stats import ratio, stats
from ray_jobs.core.batches import global_batches, shard
from ray_jobs.data.order import epoch_order
from ray_jobs.data.parquet import read_dataset
from ray_jobs.observability.process_stats import peak_rss_bytes


def measure_ingest(path: str, batch_size: int, seed: int, repetitions: int) -> dict[str, Any]:
    """Rows/s from Parquet to training batches, and from Parquet to an Arrow table with pyarrow alone.

    raypar: ``read_dataset`` (read + validate) then one epoch of the loop's indexing, every
    global batch. The first repetition warms the page cache and is dropped.
    """
    rss_at_start = peak_rss_bytes()
    raypar_s, pyarrow_s = [], []
    num_rows = 0
    for _ in range(repetitions + 1):
        began = time.perf_counter()
        table = pq.read_table(path)
        pyarrow_s.append(time.perf_counter() - began)
        num_rows = table.num_rows
        del table

        began = time.perf_counter()
        dataset = read_dataset(path)
        features, targets = dataset.tensors()
        for batch in global_batches(epoch_order(dataset.num_rows, seed, 0, True), batch_size):
            rows = shard(batch, 1, 0)
            features[rows], targets[rows]
        raypar_s.append(time.perf_counter() - began)
        del dataset, features, targets
    return {
        "rows": num_rows,
        "batched_rows": (num_rows // batch_size) * batch_size,
        "raypar_seconds": raypar_s[1:],
        "pyarrow_seconds": pyarrow_s[1:],
        "rss_at_start_bytes": rss_at_start,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def ingest_in_ray_worker(bench: Bench) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # A fresh worker (its own peak RSS) on this node, where the bench wrote the Parquet file.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(num_cpus=1, max_calls=1, scheduling_strategy=here)(measure_ingest)
    return ray.get(
        task.remote(bench.ddp_data, bench.suite.ddp.batch_size, 0, bench.suite.ingest_repetitions),
        timeout=PEER_TIMEOUT_S,
    )


def ingest_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    data_parallel = results.get("data_parallel")
    consumption = data_parallel["ddp_overhead"]["raypar"]["samples_per_second"] if data_parallel else None
    bench.log("[bench] ingest: Parquet -> batches in one Ray worker vs pyarrow alone")
    result = ingest_in_ray_worker(bench)
    raypar_rps = stats([result["batched_rows"] / s for s in result["raypar_seconds"]])
    pyarrow_rps = stats([result["rows"] / s for s in result["pyarrow_seconds"]])
    return {
        "file": bench.ddp_data,
        "rows": result["rows"],
        "file_bytes": os.path.getsize(bench.ddp_data),
        "raypar_rows_per_second": raypar_rps,
        "pyarrow_rows_per_second": pyarrow_rps,
        "raypar_over_pyarrow": ratio(raypar_rps, pyarrow_rps),
        "ddp_samples_per_second": consumption,
        "ingest_over_training": ratio(raypar_rps, consumption) if consumption else None,
        "worker_rss_at_start_bytes": result["rss_at_start_bytes"],
        "worker_peak_rss_bytes": result["peak_rss_bytes"],
    }
