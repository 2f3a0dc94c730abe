"""bench.md's sections for the GPU cases (``--suite gpu``)."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import fmt, markdown_table, workload_line


def gpu_sections(results: dict[str, Any]) -> list[str]:
    return (
        _data_parallel(results.get("gpu_data_parallel"))
        + _precision(results.get("gpu_precision"))
        + _pipeline(results.get("gpu_pipeline"))
        + _lm(results.get("gpu_lm"))
    )


def _data_parallel(case: dict[str, Any] | None) -> list[str]:
    if not case:
        return []
    rows = [
        [
            p["num_gpus"],
            fmt(p["samples_per_second"]),
            fmt(p["per_gpu_over_plain_loop"], ".3f"),
            fmt(p["over_torch_ddp"], ".3f"),
        ]
        for p in case["points"]
    ]
    return [
        "",
        f"## GPU 1. DDP over 1 to {case['num_gpus']} GPU(s) beside plain PyTorch",
        "",
        f"{workload_line(case['workload'])}. The plain loop: one process on one GPU, no Ray, the same data "
        f"(on the GPU), order and steps: {fmt(case['plain_loop'])} samples/s. Plain DDP: "
        "`torch.multiprocessing.spawn`, one process per GPU, nccl.",
        "",
        markdown_table(["GPUs", "raypar DDP samples/s", "per GPU / plain loop", "raypar / plain DDP (nccl)"], rows),
        "",
        f"DataParallel over {case['num_gpus']} GPU(s) / DDP over as many: {fmt(case['dp_over_ddp'], '.3f')}.",
    ]


def _precision(case: dict[str, Any] | None) -> list[str]:
    if not case:
        return []
    figures = case["figures"]
    rows = [
        [
            key.replace("-", ", "),
            fmt(f["samples_per_second"]),
            fmt(f["final_loss"], ".5f"),
            " ".join(f"{loss:.4f}" for loss in (case["loss_curves"][key] or [[]])[0]),
        ]
        for key, f in figures.items()
    ]
    return [
        "",
        "## GPU 2. fp32 against bf16 on one GPU",
        "",
        f"{workload_line(case['workload'])}; `--precision bf16`: autocast over the forward and loss, float32 "
        "weights and optimizer state.",
        "",
        markdown_table(["run", "samples/s", "final loss", "loss per epoch (first run)"], rows),
        "",
        f"bf16 / fp32 samples/s: raypar {fmt(case['raypar_bf16_over_fp32'], '.2f')}, plain loop "
        f"{fmt(case['plain_bf16_over_fp32'], '.2f')}; raypar / plain loop in bf16 "
        f"{fmt(case['raypar_over_plain_bf16'], '.3f')}; bf16 / fp32 final loss (raypar) "
        f"{fmt(case['raypar_bf16_over_fp32_final_loss'], '.3f')}.",
    ]


def _pipeline(case: dict[str, Any] | None) -> list[str]:
    if not case:
        return []
    shared = " (two stages sharing one GPU)" if case["gpus_per_stage"] < 1 else ""
    rows = [
        [row["schedule"], row["transport"], fmt(row["samples_per_second"]), fmt(row["over_sequential"], ".2f")]
        for row in case["rows"]
    ]
    return [
        "",
        f"## GPU 3. The pipeline over GPUs: S={case['num_stages']}, M={case['num_microbatches']}, "
        f"--gpus-per-stage {case['gpus_per_stage']:g}{shared}",
        "",
        f"{workload_line(case['workload'])}.",
        "",
        markdown_table(["schedule", "transport", "samples/s", "/ sequential"], rows),
    ]


def _lm(case: dict[str, Any] | None) -> list[str]:
    if not case:
        return []
    work, n = case["workload"], case["num_gpus"]
    names = {"raypar_ddp": "raypar DDP", "torch_ddp": "torch DDP (spawn, nccl)", "raypar_fsdp": "raypar FSDP"}
    peak = case["peak_tflops_per_gpu"]
    return [
        "",
        f"## GPU 4. A GPT-2-small shape in bf16 on {n} GPU(s): tokens/s and MFU",
        "",
        f"`gpt` {work['n_layer']} x {work['n_embd']}, {work['n_head']} heads, T = {work['block_size']}, byte "
        f"tokens of the standard library's sources, global batch {work['batch_size']} rows, bf16. MFU: tokens/s x "
        f"{case['flops_per_token'] / 1e6:,.0f} MFLOPs a token (6N + 12LCT) over "
        + (f"{peak:g} TFLOPS per GPU (bf16, the data sheet's)." if peak else "no known peak for this card."),
        "",
        markdown_table(
            ["side", "tokens/s", "MFU"],
            [
                [
                    name,
                    fmt(case["tokens_per_second"][side]),
                    fmt(case["mfu"][side], ".1%"),
                ]
                for side, name in names.items()
            ],
        ),
        "",
        f"raypar DDP / torch DDP: {fmt(case['ddp_over_torch'], '.3f')}; raypar FSDP / raypar DDP: "
        f"{fmt(case['fsdp_over_ddp'], '.3f')}.",
    ]
