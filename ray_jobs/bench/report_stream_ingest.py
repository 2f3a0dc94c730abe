"""bench.md's section for the stream_ingest case: 16x the data, memory against stream ingest."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import MIB, markdown_table, workload_line


def stream_ingest_section(stream: dict[str, Any] | None) -> list[str]:
    if not stream:
        return []
    runs = stream["runs"]
    rows = [
        [
            run["data"],
            f"{run['rows']:,}",
            f"{run['file_bytes'] / MIB:,.0f}",
            run["ingest"],
            f"{run['driver_peak_rss_bytes'] / MIB:,.0f}",
            f"{max(run['worker_peak_rss_bytes']) / MIB:,.0f}",
            f"{run['samples_per_second']:,.0f}",
            f"{run['data_wait_fraction']:.3f}",
            f"{run['bytes_read'] / (run['file_bytes'] * stream['workload']['epochs']):.2f}",
        ]
        for run in runs
    ]
    growth = [
        [mode, f"{g['file_bytes'] / MIB:,.0f}", f"{g['driver_bytes'] / MIB:+,.0f}", f"{g['worker_bytes'] / MIB:+,.0f}"]
        for mode, g in stream["growth"].items()
    ]
    fastest = max(run["samples_per_second"] for run in runs if run["ingest"] == "stream")
    return [
        "",
        "## 7. Streaming ingest: 16x the data, and what each process holds",
        "",
        f"{workload_line(stream['workload'])} (the large data; the small one has 1/16 of its rows); DDP with "
        f"{stream['num_workers']} workers, each driver a process of its own (its peak RSS is its own). `memory` "
        "reads the data whole in the driver and maps it into every worker; `stream` reads it window by window "
        "through one reader actor. The stream's reader alone delivered "
        f"{stream['reader_rows_per_second']:,.0f} rows/s, {stream['reader_rows_per_second'] / fastest:.1f}x the "
        "fastest streamed DDP run's consumption.",
        "",
        markdown_table(
            [
                "data",
                "rows",
                "file, MiB",
                "ingest",
                "driver peak RSS, MiB",
                "largest worker peak RSS, MiB",
                "samples/s",
                "data wait",
                "bytes read per epoch / file",
            ],
            rows,
        ),
        "",
        markdown_table(["ingest", "more data, MiB", "driver peak RSS, MiB", "worker peak RSS, MiB"], growth),
    ]
