"""bench.md's section for the comm_model case: bytes per step of each layout on 2 nodes x 8 GPUs."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import markdown_table

GIB = 2**30


def comm_model_section(model: dict[str, Any] | None) -> list[str]:
    if not model:
        return []
    lines = [
        "",
        f"## Communication per step, computed: {model['nodes']} nodes x {model['gpus_per_node']} GPUs",
        "",
        f"Not measured: bytes over every link of one optimizer step (global batch {model['global_batch']} "
        f"sequences; a pipeline's M = {model['microbatches_per_stage']}·S micro-batches per replica), by the "
        "model in `ray_jobs/bench/cases/comm_model.py`: ring collectives, weights gathered in bf16, gradients "
        "reduced in fp32, activations in bf16. What crosses nodes is what a slow network pays for.",
    ]
    for shape in model["models"]:
        rows = [
            [
                layout["layout"],
                "-" if layout["intra_bytes"] is None else f"{layout['intra_bytes'] / GIB:.1f}",
                "-" if layout["inter_bytes"] is None else f"{layout['inter_bytes'] / GIB:.1f}",
                f"{layout['bubble']:.3f}",
                layout["note"],
            ]
            for layout in shape["layouts"]
        ]
        lines += [
            "",
            f"{shape['name']} ({shape['layers']} layers, d_model {shape['d_model']}, context {shape['context']}):",
            "",
            markdown_table(["layout", "within nodes (GiB)", "between nodes (GiB)", "bubble", ""], rows),
        ]
    return lines
