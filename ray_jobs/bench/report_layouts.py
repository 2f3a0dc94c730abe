"""bench.md's section for the layouts case: four processes laid five ways, beside DDP."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import fmt, markdown_table

NAMES = {
    "ddp": "DDP, 4 workers",
    "hsdp": "HSDP, 2 groups of 2 shards",
    "pipeline": "pipeline, 4 stages",
    "dp_x_pp": "DP x PP, 2 replicas x 2 stages",
    "fsdp_x_pp": "FSDP x PP, 2 stages each sharded over 2 copies",
}


def layouts_section(case: dict[str, Any] | None) -> list[str]:
    if not case:
        return []
    work = case["workload"]
    rows = [
        [NAMES[layout], fmt(case["tokens_per_second"][layout]), fmt(case["over_ddp"][layout], ".2f")]
        for layout in NAMES
    ]
    return [
        "",
        f"## Two-dimensional layouts: {case['processes']} processes, one global batch",
        "",
        f"The gpt ({work['n_layer']} x {work['n_embd']}, T = {work['block_size']}), global batch {work['batch_size']}, "
        f"M = {case['num_microbatches']} micro-batches per replica. With fewer cores than processes they share "
        "the cores: the ratios measure each layout's overhead (collectives, bubble, process count), not scaling.",
        "",
        markdown_table(["layout", "tokens/s", "÷ DDP"], rows),
    ]
