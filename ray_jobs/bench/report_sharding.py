"""bench.md's section for the sharding case: FSDP beside DDP, and activation checkpointing."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import fmt, markdown_table

KIB = 1024


def sharding_section(case: dict[str, Any] | None) -> list[str]:
    if not case:
        return []
    n = case["num_workers"]
    rows = []
    for strategy in ("ddp", "fsdp"):
        for rank, held in enumerate(case["model_state_bytes"][strategy]):
            rows.append(
                [strategy, rank]
                + [f"{held[key] / KIB:,.1f}" for key in ("parameters", "gradients", "optimizer", "total")]
                + [fmt(case["samples_per_second"][strategy]) if rank == 0 else ""]
            )
    activations = case["activations"]
    gpt, work = activations["gpt"], case["workload"]
    return [
        "",
        f"## 8. Sharded data parallel: FSDP beside DDP, {n} workers, AdamW",
        "",
        f"`gpt` {work['n_layer']} layers, {work['n_head']} heads, width {work['n_embd']}, T = {work['block_size']}, "
        f"on {work['rows']:,} rows of byte tokens, global batch {work['batch_size']} rows, {work['epochs']} epochs "
        f"of {work['rows'] // work['batch_size']} steps, AdamW. Model state: the bytes each worker holds after its "
        "last step in its parameters, gradients and optimizer state, counted from its own tensors (an FSDP "
        "parameter's local shard; each storage once), not RSS; DDP's gradient buckets (one more copy of the "
        f"gradients) are not counted. FSDP holds {case['model_state_ratio']:.3f} of DDP's per worker (1/{n} would "
        f"be {1 / n:.3f}); its samples/s are {fmt(case['samples_per_second_ratio'], '.2f')} of DDP's.",
        "",
        markdown_table(
            [
                "strategy",
                "world rank",
                "parameters, KiB",
                "gradients, KiB",
                "optimizer, KiB",
                "total, KiB",
                "samples/s",
            ],
            rows,
        ),
        "",
        "FSDP's samples/s over DDP's against the gpt's width (the same layers, tokens and batch): the wider, "
        "the more a step's compute outweighs FSDP's three collectives per block.",
        "",
        markdown_table(
            ["width", "parameters", "DDP samples/s", "FSDP samples/s", "FSDP / DDP", "FSDP model state / DDP's"],
            [
                [
                    width["n_embd"],
                    f"{width['parameters']:,}",
                    fmt(width["samples_per_second"]["ddp"]),
                    fmt(width["samples_per_second"]["fsdp"]),
                    fmt(width["samples_per_second_ratio"], ".2f"),
                    f"{width['model_state_ratio']:.3f}",
                ]
                for width in case.get("widths", [])
            ],
        ),
        "",
        f"Activation memory, one process: `gpt` {gpt['n_layer']} layers, {gpt['n_head']} heads, width "
        f"{gpt['n_embd']}, {gpt['batch_size']} sequences of {gpt['block_size']} tokens, vocabulary "
        f"{gpt['vocab_size']} ({activations['parameter_bytes'] / KIB / KIB:.1f} MiB of weights): the bytes "
        "autograd holds for backward when the forward ends (saved-tensor hooks; with checkpointing, each "
        "block's input), and one forward and backward's time.",
        "",
        markdown_table(
            ["", "held for backward, MiB", "forward + backward, ms"],
            [
                [
                    side,
                    f"{activations[side]['saved_bytes'] / KIB / KIB:,.2f}",
                    fmt(activations[side]["step_seconds"], ".1f", 1e3),
                ]
                for side in ("plain", "checkpointed")
            ],
        ),
        "",
        f"Checkpointing holds {activations['saved_ratio']:.3f} of the activations and takes "
        f"{fmt(activations['step_time_ratio'], '.2f')} of the time (one more forward per block).",
    ]
