"""bench.md's section for the lm case: the gpt in tokens/s, DDP beside its torch peer, the pipeline
beside its sequential schedule."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import MIB, fmt, markdown_table
from ray_jobs.bench.stats import gpipe_bubble


def lm_section(lm: dict[str, Any] | None) -> list[str]:
    if not lm:
        return []
    work, ddp, pipe = lm["workload"], lm["ddp"], lm["pipeline"]
    n, s, m = ddp["num_workers"], pipe["num_stages"], pipe["num_microbatches"]
    return [
        "",
        "## 9. Language model: the gpt in tokens/s",
        "",
        f"`gpt` n_layer {work['n_layer']} n_head {work['n_head']} n_embd {work['n_embd']}, block_size (T) "
        f"{work['block_size']}, vocabulary {work['vocab_size']} (byte tokens of the standard library's sources), "
        f"{work['rows']:,} rows, global batch {work['batch_size']} rows ({lm['tokens_per_step']:,} tokens), "
        f"{work['epochs']} epochs of {work['rows'] // work['batch_size']} steps; `--task lm`, the mean token "
        "cross-entropy. Tokens/s = samples/s x T. DDP: raypar against the plain torch.distributed peer "
        f"(`mp.spawn`, gloo; the same gpt, weights, tokens and batch), {n} workers x 1 CPU and torch thread. "
        f"Pipeline: {s} stage actors x {pipe['threads_per_stage']} CPU, M={m} micro-batches, the p2p transport, "
        "against its sequential schedule (one micro-batch at a time through the same stages) and against the "
        f"whole gpt in one process ({pipe['threads_per_stage']} thread, the plain loop).",
        "",
        markdown_table(
            ["measure", "raypar DDP (Ray Train)", "torch DDP (spawn, gloo)", "raypar / torch"],
            [
                [
                    "steady tokens/s (epoch loops only)",
                    fmt(ddp["raypar_tokens_per_second"]),
                    fmt(ddp["torch_tokens_per_second"]),
                    fmt(ddp["tokens_per_second_ratio"], ".3f"),
                ],
                [
                    "peak RSS per worker (the largest), MiB",
                    fmt(ddp["raypar_peak_rss_bytes"], ".0f", 1 / MIB),
                    fmt(ddp["torch_peak_rss_bytes"], ".0f", 1 / MIB),
                    "-",
                ],
            ],
        ),
        *_compile_lines(lm.get("compile")),
        "",
        markdown_table(
            ["pipeline schedule", "tokens/s", "vs sequential", "vs single process", "bubble", "bubble theory"],
            [
                [
                    r["schedule"],
                    fmt(r["tokens_per_second"]),
                    fmt(r["speedup_vs_sequential"], ".2f"),
                    fmt(r["speedup_vs_single_process"], ".2f"),
                    fmt(r["bubble_fraction"], ".3f"),
                    f"{gpipe_bubble(s, m):.3f}" if r["schedule"] != "sequential" else "-",
                ]
                for r in pipe["schedules"]
            ]
            + [["single process, whole gpt", fmt(pipe["single_process_tokens_per_second"]), "-", "-", "-", "-"]],
        ),
    ]


def _compile_lines(compiled: dict[str, Any] | None) -> list[str]:
    if not compiled:
        return []
    seconds = compiled["compile_seconds"]
    return [
        "",
        f"`--compile` (each block's forward through torch.compile, inductor): raypar DDP at "
        f"{fmt(compiled['compiled_tokens_per_second'])} steady tokens/s against "
        f"{fmt(compiled['eager_tokens_per_second'])} eager, **{fmt(compiled['tokens_per_second_ratio'], '.2f')}x**; "
        + (
            f"compiling took {fmt(seconds, '.1f')} s of the first epoch (its excess over a steady epoch, less "
            "eager's), apart from the steady figure."
            if seconds
            else "one epoch per run: no compile time apart."
        ),
    ]
