"""bench.md's section for the stage_memory case: one model cut into more stages, each stage's memory."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import MIB, markdown_table, workload_line


def stage_memory_section(memory: dict[str, Any] | None) -> list[str]:
    if not memory:
        return []
    rows = []
    for row in memory["rows"]:
        for stage, (params, rss, device) in enumerate(
            zip(row["stage_parameter_bytes"], row["stage_peak_rss_bytes"], row["stage_peak_device_bytes"])
        ):
            rows.append(
                [
                    row["num_stages"],
                    stage,
                    f"{params / MIB:.1f}",
                    f"{rss / MIB:.0f}",
                    f"{device / MIB:.0f}" if device is not None else "-",
                ]
            )
    return [
        "",
        "## 6. Pipeline stage memory: one model, more stages",
        "",
        f"{workload_line(memory['workload'])}; {memory['cpus_per_stage']:g} CPU per stage. Each stage builds only its "
        "own layers (the model exists whole on the meta device only) and is sent only its slice of the weights; "
        "peak RSS is the stage process's VmHWM over the whole run (weights, gradients, optimizer state, "
        "activations, and the ~300 MiB of torch and pyarrow every process holds).",
        "",
        markdown_table(["stages", "stage", "its parameters, MiB", "peak RSS, MiB", "peak GPU memory, MiB"], rows),
    ]
