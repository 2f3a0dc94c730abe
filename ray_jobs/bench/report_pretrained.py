"""bench.md's section for the pretrained case: each worker's memory at start, ddp against fsdp."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import MIB, markdown_table


def pretrained_section(pretrained: dict[str, Any] | None) -> list[str]:
    if not pretrained:
        return []
    size = pretrained["checkpoint_bytes"]
    rows = [
        [strategy, *(f"{rss / MIB:,.0f}" for rss in per_rank), f"{pretrained['startup_ratio'][strategy]:.2f}×"]
        for strategy, per_rank in pretrained["startup_rss_bytes"].items()
    ]
    shape = pretrained["shape"]
    ranks = [f"rank {rank}, MiB" for rank in range(pretrained["num_workers"])]
    return [
        "",
        "## Starting from a pretrained checkpoint: each worker's memory at start",
        "",
        f"A Hugging Face GPT-2 ({shape['n_layer']} layers × {shape['n_embd']}, vocabulary {shape['vocab_size']:,}), "
        f"{size / MIB:,.0f} MiB of safetensors written locally, fine-tuned with `--model hf:DIR` on "
        f"{pretrained['num_workers']} workers. Each worker's peak RSS from just before it builds the model to the "
        "start of training, over its RSS just before (the weights' cost, not torch's); the ratio is the larger "
        "worker's over the checkpoint's bytes. fsdp builds on meta, shards, and reads only its own rows.",
        "",
        markdown_table(["strategy", *ranks, "÷ checkpoint"], rows),
        *_export_line(pretrained.get("export") or {}),
    ]


def _export_line(export: dict[str, Any]) -> list[str]:
    """fsdp's way out: each rank wrote its slices; the most the driver held at once consolidating them."""
    if export.get("export_peak_bytes") is None:
        return []
    size, peak = export["export_bytes"], export["export_peak_bytes"]
    return [
        "",
        f"At the end, each fsdp rank wrote its own slices of the weights; the driver consolidated the "
        f"{size / MIB:,.0f} MiB into `model.safetensors` holding at most {peak / MIB:,.0f} MiB at once "
        f"({peak / size:.2f}× the weights; `tracemalloc`): one tensor at a time, so its peak is the largest "
        "tensor's buffer and the slices copied into it, whatever the model's size.",
    ]
