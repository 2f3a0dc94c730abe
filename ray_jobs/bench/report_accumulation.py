"""bench.md's section for the accumulation case: K micro-steps against one at the same global batch."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import MIB, fmt, markdown_table, workload_line


def accumulation_section(accum: dict[str, Any] | None) -> list[str]:
    if not accum:
        return []
    base, most = accum["runs"][0], accum["runs"][-1]
    k1, k = base["grad_accum_steps"], most["grad_accum_steps"]
    saved_ratio = most["saved_activation_peak_bytes"] / base["saved_activation_peak_bytes"]
    return [
        "",
        f"## 8. Gradient accumulation: K={k} against K={k1} at one global batch",
        "",
        f"{workload_line(accum['workload'])}; raypar DDP, {accum['num_workers']} workers x 1 CPU, each taking "
        f"{accum['rows_per_worker']:,} rows of every global batch in K micro-steps (`--grad-accum-steps K`: one "
        "all-reduce and one optimizer step per global batch). Peak RSS: each worker process's VmHWM over the "
        "whole fit, the largest worker's (weights, gradients, activations, the data, and the ~500 MiB torch and "
        "Ray hold in any worker); on Linux, glibc's malloc keeps freed blocks below its mmap threshold (which "
        "rises to 32 MiB) in its heap, so a worker's RSS need not fall with K even where its live tensors do "
        "(docs/performance.md). Activations: the bytes autograd holds for backward at the step's peak, read "
        "with `torch.autograd.graph.saved_tensors_hooks` over one worker's step (`train_step` on its rows of "
        "one global batch, replayed in the bench's process): every saved tensor's bytes from its forward "
        "until its graph is freed, once however many ops save it, parameters not counted, nor the gradients "
        "of activations during backward.",
        "",
        markdown_table(
            ["measure", f"K={k1}", f"K={k}", f"K={k} / K={k1}"],
            [
                [
                    "steady samples/s (epoch loops only)",
                    fmt(base["samples_per_second"]),
                    fmt(most["samples_per_second"]),
                    fmt(accum["samples_per_second_ratio"], ".2f"),
                ],
                [
                    "peak RSS per worker (the largest), MiB",
                    fmt(base["peak_rss_bytes"], ".0f", 1 / MIB),
                    fmt(most["peak_rss_bytes"], ".0f", 1 / MIB),
                    fmt(accum["peak_rss_ratio"], ".2f"),
                ],
                [
                    "activations held for backward, one worker's step at its peak, MiB",
                    f"{base['saved_activation_peak_bytes'] / MIB:.1f}",
                    f"{most['saved_activation_peak_bytes'] / MIB:.1f}",
                    f"{saved_ratio:.2f}",
                ],
            ],
        ),
    ]
