"""The streaming case: DDP over a large Parquet dataset and one 16x smaller, in both ingest
modes, each driver a process of its own; what the driver and each worker hold at their peak,
whether the stream keeps the workers fed, and how many bytes it read.

The memory path holds the dataset in the driver and maps it into every worker, so its peaks
grow with the data; a stream's should not (the issue's bound: under 250 MB more for 16x the data).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

import pyarrow.parquet as pq

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.peer import PEER_TIMEOUT_S
from ray_jobs.data.parquet import ROW_GROUP_ROWS, synthesize

SMALLER = 16  # the small dataset is this many times smaller than the large one
CHUNK_ROWS = 65536  # rows synthesised at a time: writing a large dataset never holds it whole
MODES = ("memory", "stream")


def stream_ingest_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    work = bench.suite.stream
    sizes = {"large": work.rows, "small": work.rows // SMALLER}
    files = {name: os.path.join(bench.out, "data", f"stream-{name}.parquet") for name in sizes}
    for name, rows in sizes.items():
        bench.log(f"[bench] streaming: writing {rows:,} rows")
        write_rows(files[name], rows, work.in_features, work.out_features)
    runs = []
    for name in sizes:
        for mode in MODES:
            bench.log(f"[bench] streaming: DDP on the {name} data, --ingest {mode}")
            runs.append(
                {
                    "data": name,
                    "ingest": mode,
                    "rows": sizes[name],
                    "file_bytes": os.path.getsize(files[name]),
                    **ddp_process(bench, files[name], mode),
                }
            )
    bench.log("[bench] streaming: the reader alone, one epoch of the large data")
    delivered = reader_rows_per_second(files["large"])
    return {
        "workload": asdict(work),
        "num_workers": bench.suite.ddp_workers,
        "runs": runs,
        "reader_rows_per_second": delivered,
        **_growth(runs),
    }


def write_rows(path: str, rows: int, in_features: int, out_features: int) -> None:
    """A synthetic regression set of ``rows`` rows, written ``CHUNK_ROWS`` at a time."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    writer = None
    for start in range(0, rows, CHUNK_ROWS):
        table = synthesize(min(CHUNK_ROWS, rows - start), in_features, out_features, "regression", seed=start)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
    writer.close()


def ddp_process(bench: Bench, data: str, mode: str) -> dict[str, Any]:
    """``python -m ray_jobs.ddp`` as its own process on the bench's cluster: its peak RSS is the
    driver's alone; the workers' come from its summary.json."""
    import ray

    work, name = bench.suite.stream, f"stream-{mode}-{os.getpid()}-{time.time_ns()}"
    argv = [
        sys.executable,
        "-m",
        "ray_jobs.ddp",
        "--address",
        ray.get_runtime_context().gcs_address,
        "--data",
        data,
        "--ingest",
        mode,
        "--model",
        work.model,
        "--hidden",
        str(work.hidden),
        "--depth",
        str(work.depth),
        "--epochs",
        str(work.epochs),
        "--batch-size",
        str(work.batch_size),
        "--num-workers",
        str(bench.suite.ddp_workers),
        "--storage-path",
        bench.storage_path,
        "--name",
        name,
    ]
    # The bench's own Ray runs with token auth; a client sends the token only when told to.
    log = os.path.join(bench.out, f"{name}.log")
    with open(log, "w") as output:
        process = subprocess.Popen(
            argv, env={**os.environ, "RAY_AUTH_MODE": "token"}, stdout=output, stderr=subprocess.STDOUT
        )
    began = time.perf_counter()
    status, peak_rss = _wait_with_usage(process, PEER_TIMEOUT_S)
    if status != 0:
        raise RuntimeError(f"the {mode} DDP run failed (exit {status}); its output: {log}")
    run_dir = os.path.join(bench.storage_path, name)
    with open(os.path.join(run_dir, "summary.json")) as handle:
        summary = json.load(handle)
    bench.clean(run_dir)
    os.remove(log)
    return {
        "wall_s": time.perf_counter() - began,
        "driver_peak_rss_bytes": peak_rss,
        "worker_peak_rss_bytes": summary["worker_peak_rss_bytes"],
        "samples_per_second": summary["samples_per_second"],
        "data_wait_fraction": summary["data_wait_fraction"],
        "bytes_read": summary["bytes_read"],
    }


def _wait_with_usage(process: subprocess.Popen, timeout_s: float) -> tuple[int, int]:
    """Reap the child ourselves: ``wait4`` gives this one child's peak RSS (Popen.wait would not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must not wait again
            return process.returncode, usage.ru_maxrss * 1024  # KiB on Linux
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"a streaming-case DDP run took longer than {timeout_s:g} s")
        time.sleep(0.5)


def reader_rows_per_second(path: str) -> float:
    """Rows per second the stream's reader delivers, alone, over one epoch: what the workers'
    consumption is compared with (the headroom)."""
    import ray

    from ray_jobs.core.config import TrainConfig
    from ray_jobs.data.order import stream_windows
    from ray_jobs.data.stream import plan_stream, start_reader

    cfg = TrainConfig(data=path, ingest="stream")
    dataset = plan_stream(path, cfg.feature_column, cfg.target_column, cfg.task, None, cfg.shuffle_window_rows)
    reader = start_reader(dataset, cfg.seed, True, 1)
    try:
        began = time.perf_counter()
        for index in range(len(stream_windows(dataset.block_rows, cfg.seed, 0, True, dataset.window_rows))):
            ray.get(reader.window.remote(0, index))
        return dataset.num_rows / (time.perf_counter() - began)
    finally:
        ray.kill(reader)


def _growth(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per ingest mode: how much more the driver and the largest worker held for the large data."""
    by = {(run["data"], run["ingest"]): run for run in runs}
    growth = {}
    for mode in MODES:
        large, small = by[("large", mode)], by[("small", mode)]
        growth[mode] = {
            "driver_bytes": large["driver_peak_rss_bytes"] - small["driver_peak_rss_bytes"],
            "worker_bytes": max(large["worker_peak_rss_bytes"]) - max(small["worker_peak_rss_bytes"]),
            "file_bytes": large["file_bytes"] - small["file_bytes"],
        }
    return {"growth": growth}
