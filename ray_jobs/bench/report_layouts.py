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
    ] + _comm_rows(case.get("comm_bytes_per_step"), case.get("comm_agreement"))


KIND_NAMES = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "broadcast": "broadcast",
    "send": "send",
    "recv": "receive",
}


def _comm_rows(comm: dict[str, Any] | None, worst: float | None) -> list[str]:
    """The communication model's bytes per step beside those the runs' processes counted."""
    if not comm:
        return []
    rows = [
        [NAMES[layout], KIND_NAMES[kind], f"{expected:,.0f}", f"{sides['measured'].get(kind, 0):,.0f}"]
        for layout, sides in comm.items()
        for kind, expected in sides["model"].items()
        if expected or sides["measured"].get(kind)
    ]
    return [
        "",
        "Bytes handed to collectives and sends per step, all processes together, as the communication model "
        "(`handed` in `cases/comm_model.py`) states them and as the processes counted them (`--count-comm-bytes`); "
        f"worst gap {worst:.2%}:",
        "",
        markdown_table(["layout", "call", "model bytes", "counted bytes"], rows),
    ]
