"""The GPU language-model case (``--suite gpu``, ``gpu_lm``): a GPT-2-small shape in bf16 on every
GPU of the cluster, in tokens/s and MFU, raypar DDP beside plain ``torch.distributed`` DDP (nccl)
on the same GPUs, and raypar FSDP beside both; their runs interleaved.

MFU is each side's steady tokens/s times the gpt's training FLOPs per token
(``observability.throughput.flops_per_token``: ``6 N + 12 L C T``) over the GPUs' bf16 peak (the
data sheet's, by the device's name; None for a card the table lacks)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict
from typing import Any

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.cases.data_parallel import raypar_data_parallel
from ray_jobs.bench.cases.gpu import require_gpus
from ray_jobs.bench.cases.lm import per_token, write_lm_tokens
from ray_jobs.bench.stats import ratio, steady, summarise
from ray_jobs.bench.suites import LmWorkload
from ray_jobs.observability.throughput import flops_per_token, model_flops_utilisation, peak_tflops

PRECISION = "bf16"
FIGURE = ("median", "min", "max")


def gpu_lm_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    num_gpus = require_gpus()
    per_gpu = bench.suite.gpu_lm  # each GPU's rows: the global batch grows with the GPUs
    work = dataclasses.replace(per_gpu, rows=per_gpu.rows * num_gpus, batch_size=per_gpu.batch_size * num_gpus)
    data = write_lm_tokens(os.path.join(bench.out, "data", "gpu_lm.parquet"), work.rows, work.block_size)
    raw: dict[str, list[dict]] = {"raypar_ddp": [], "torch_ddp": [], "raypar_fsdp": []}
    for rep in range(bench.suite.fit_repetitions):
        bench.measure(
            raw["raypar_ddp"],
            f"gpu lm: raypar DDP {num_gpus} GPU, bf16",
            rep,
            lambda: raypar_data_parallel(
                bench, "ddp", num_gpus, use_gpu=True, precision=PRECISION, work=work, data=data
            ),
        )
        bench.measure(
            raw["torch_ddp"],
            f"gpu lm: torch DDP (nccl) {num_gpus} GPU, bf16",
            rep,
            lambda: bench.peer(work, data, num_gpus, 1, "cuda", PRECISION),
        )
        bench.measure(
            raw["raypar_fsdp"],
            f"gpu lm: raypar FSDP {num_gpus} GPU, bf16",
            rep,
            lambda: _fsdp(bench, work, data, num_gpus),
        )
    flops = _flops_per_token(bench, work, data)
    os.remove(data)
    return gpu_lm_figures(raw, work, num_gpus, flops, _peak())


def gpu_lm_figures(
    raw: dict[str, list[dict]], work: LmWorkload, num_gpus: int, flops: float, peak: float | None
) -> dict[str, Any]:
    """The case's section of ``bench.json``: each side's tokens/s and MFU, and the ratios."""
    tokens = {side: per_token(summarise(runs)["samples_per_second"], work.block_size) for side, runs in raw.items()}

    def mfu(figure: dict[str, Any]) -> dict[str, Any] | None:
        if peak is None:
            return None
        return {k: model_flops_utilisation(v, flops, peak, num_gpus) for k, v in figure.items() if k in FIGURE}

    return {
        "workload": {**asdict(work), "precision": PRECISION},
        "num_gpus": num_gpus,
        "flops_per_token": flops,
        "peak_tflops_per_gpu": peak,
        "tokens_per_second": tokens,
        "mfu": {side: mfu(figure) for side, figure in tokens.items()},
        "ddp_over_torch": ratio(tokens["raypar_ddp"], tokens["torch_ddp"]),
        "fsdp_over_ddp": ratio(tokens["raypar_fsdp"], tokens["raypar_ddp"]),
        "raw": raw,
    }


def _fsdp(bench: Bench, work: LmWorkload, data: str, num_gpus: int) -> dict[str, Any]:
    cfg = dataclasses.replace(bench.config(work, data, f"fsdp{num_gpus}-gpu"), precision=PRECISION)
    summary = bench.fit_workers(cfg, "fsdp", num_gpus, use_gpu=True)
    return {"samples_per_second": steady(summary.extra["epoch_seconds"], work.samples_per_epoch)}


def _flops_per_token(bench: Bench, work: LmWorkload, data: str) -> float:
    from ray_jobs.core.model_init import meta_model
    from ray_jobs.driver.prepare import load_data

    cfg = bench.config(work, data, "flops")
    model = meta_model(cfg, load_data(cfg))
    return flops_per_token(model, {"n_layer": work.n_layer, "n_embd": work.n_embd}, work.block_size)


def _peak() -> float | None:
    import torch

    return peak_tflops(torch.cuda.get_device_name(0), PRECISION) if torch.cuda.is_available() else None
