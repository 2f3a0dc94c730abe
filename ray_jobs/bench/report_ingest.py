"""bench.md's section for the ingest case: Parquet to training batches in one Ray worker."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import MIB, fmt, markdown_table


def ingest_section(ingest: dict[str, Any] | None) -> list[str]:
    if not ingest:
        return []
    return [
        "",
        "## 5. Data ingest: Parquet to training batches in one Ray worker",
        "",
        f"{ingest['rows']:,} rows, {ingest['file_bytes'] / MIB:.2f} MiB (the DDP data). raypar: `read_dataset` "
        "(read + validate) plus one epoch of the loop's batch indexing; one worker producing every global "
        "batch, against the whole DDP job's consumption (conservative: a DDP worker indexes 1/N of each). "
        f"Worker RSS: {ingest['worker_rss_at_start_bytes'] / MIB:.0f} MiB at start, "
        f"{ingest['worker_peak_rss_bytes'] / MIB:.0f} MiB peak.",
        "",
        markdown_table(
            ["path", "rows/s", "ratio"],
            [
                ["pyarrow.parquet.read_table alone", fmt(ingest["pyarrow_rows_per_second"]), "-"],
                [
                    "raypar read_dataset + batch indexing",
                    fmt(ingest["raypar_rows_per_second"]),
                    fmt(ingest["raypar_over_pyarrow"], ".2f") + " of pyarrow",
                ],
                [
                    "DDP training consumption (samples/s)",
                    fmt(ingest["ddp_samples_per_second"]),
                    fmt(ingest["ingest_over_training"], ".1f") + "x headroom"
                    if ingest["ingest_over_training"]
                    else "-",
                ],
            ],
        ),
    ]
