"""bench.md's section for the checkpoint case: how long a checkpoint holds the loop, sync and async."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import MIB, fmt, markdown_table


def checkpoint_section(case: dict[str, Any] | None) -> list[str]:
    if not case or "skipped" in case:
        return []
    work = case["workload"]
    rows = [
        [mode, fmt(case["stall_s"][mode], ".3f"), len(case["stall_s"][mode]["values"])] for mode in ("sync", "async")
    ]
    return [
        "",
        f"## Checkpoint stall: --checkpoint-mode sync and async, ddp on {case['num_workers']} workers",
        "",
        f"mlp {work['hidden']} x {work['depth']}: {case['training_state_bytes'] / MIB:,.0f} MiB of training state "
        f"(weights and SGD's momentum) a checkpoint, to {case['storage']} storage. The stall: world rank 0's "
        "time from a checkpoint's start to the training loop going on (every checkpoint but the run's last, "
        f"always sync). Async stalls {fmt(case['async_over_sync'], '.2f')} as long as sync.",
        "",
        markdown_table(["mode", "stall per checkpoint (s)", "checkpoints"], rows),
    ]
