"""The GPU cases (``--suite gpu``): raypar on GPUs beside plain PyTorch on the same GPUs, every
figure a ratio of runs made side by side in one bench run, their repetitions interleaved.

- ``gpu_data_parallel``: DDP over 1..N GPUs against the plain single-process loop on one GPU (per
  GPU) and against plain ``torch.distributed`` DDP (nccl) over the same GPUs; DataParallel over
  every GPU against DDP over them.
- ``gpu_precision``: fp32 against bf16, raypar DDP on one GPU and the plain loop: samples/s and
  the loss curves.
- ``gpu_pipeline``: the stages over GPUs (two stages sharing one GPU on a one-GPU machine)
  against the same stages one micro-batch at a time.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.cases.data_parallel import raypar_data_parallel, worker_counts
from ray_jobs.bench.stats import ratio, steady, summarise
from ray_jobs.driver.prepare import prepare

GPU_SCHEDULES = ("sequential", "gpipe", "1f1b")


def cluster_gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def require_gpus() -> int:
    """The cluster's GPUs; none is a user error (``--suite gpu`` on a CPU cluster)."""
    gpus = cluster_gpus()
    if gpus < 1:
        raise ValueError("the GPU cases need a Ray cluster with GPUs; this one has none")
    return gpus


def _curves(runs: list[dict[str, Any]]) -> list[list[float]]:
    """Each run's per-epoch losses, taken out before the runs are summarised (they are a curve,
    not repetitions of one figure)."""
    return [run.pop("epoch_losses") for run in runs if "epoch_losses" in run]


def _per_gpu(figure: dict[str, Any], num_gpus: int) -> dict[str, Any]:
    return {k: v / num_gpus for k, v in figure.items() if k in ("median", "min", "max")}


def gpu_data_parallel_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    suite, work = bench.suite, bench.suite.ddp
    gpus = require_gpus()
    counts = worker_counts(min(gpus, suite.max_workers), work.batch_size)
    raw: dict[str, list[dict]] = {f"ddp{n}": [] for n in counts}
    raw.update({f"torch{n}": [] for n in counts if n > 1})
    raw.update({"plain": [], f"dp{gpus}": []})
    bench.log("[bench] warm-up (discarded): one 1-epoch DDP fit on one GPU, one plain-loop run")
    raypar_data_parallel(bench, "ddp", 1, epochs=1, use_gpu=True)
    bench.peer(work, bench.ddp_data, 1, 1, device="cuda")
    for rep in range(suite.fit_repetitions):
        bench.measure(raw["plain"], "plain loop, 1 GPU", rep, lambda: bench.peer(work, bench.ddp_data, 1, 1, "cuda"))
        for n in counts:
            bench.measure(
                raw[f"ddp{n}"],
                f"raypar DDP {n} GPU",
                rep,
                lambda n=n: raypar_data_parallel(bench, "ddp", n, use_gpu=True),
            )
            if n > 1:
                bench.measure(
                    raw[f"torch{n}"],
                    f"torch DDP (nccl) {n} GPU",
                    rep,
                    lambda n=n: bench.peer(work, bench.ddp_data, n, 1, "cuda"),
                )
        bench.measure(
            raw[f"dp{gpus}"],
            f"raypar DataParallel {gpus} GPU",
            rep,
            lambda: raypar_data_parallel(bench, "dp", gpus, use_gpu=True),
        )
    curves = {key: _curves(runs) for key, runs in raw.items()}
    figures = {key: summarise(runs) for key, runs in raw.items()}
    plain = figures["plain"]["samples_per_second"]
    points = []
    for n in counts:
        sps = figures[f"ddp{n}"]["samples_per_second"]
        points.append(
            {
                "num_gpus": n,
                "samples_per_second": sps,
                "per_gpu_over_plain_loop": ratio(_per_gpu(sps, n), plain),
                # one process: the plain loop is torch's DDP peer too
                "over_torch_ddp": ratio(sps, figures[f"torch{n}" if n > 1 else "plain"]["samples_per_second"]),
            }
        )
    ddp_all = figures[f"ddp{counts[-1]}"] if counts[-1] == gpus else None
    return {
        "workload": asdict(work),
        "num_gpus": gpus,
        "plain_loop": plain,
        "points": points,
        "dp_over_ddp": ratio(figures[f"dp{gpus}"]["samples_per_second"], ddp_all["samples_per_second"])
        if ddp_all
        else None,
        "final_loss": {key: figure.get("final_loss") for key, figure in figures.items()},
        "raw": raw,
        "loss_curves": curves,
    }


def gpu_precision_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    """fp32 against bf16 on one GPU, raypar DDP and the plain loop, interleaved."""
    suite, work = bench.suite, bench.suite.ddp
    require_gpus()
    raw: dict[str, list[dict]] = {f"{side}-{p}": [] for side in ("raypar", "plain") for p in ("fp32", "bf16")}
    for rep in range(suite.fit_repetitions):
        for precision in ("fp32", "bf16"):
            bench.measure(
                raw[f"plain-{precision}"],
                f"plain loop 1 GPU {precision}",
                rep,
                lambda p=precision: bench.peer(work, bench.ddp_data, 1, 1, "cuda", p),
            )
            bench.measure(
                raw[f"raypar-{precision}"],
                f"raypar DDP 1 GPU {precision}",
                rep,
                lambda p=precision: raypar_data_parallel(bench, "ddp", 1, use_gpu=True, precision=p),
            )
    curves = {key: _curves(runs) for key, runs in raw.items()}
    figures = {key: summarise(runs) for key, runs in raw.items()}
    return {
        "workload": asdict(work),
        "figures": {key: {k: f[k] for k in ("samples_per_second", "final_loss")} for key, f in figures.items()},
        **{
            f"{side}_bf16_over_fp32": ratio(
                figures[f"{side}-bf16"]["samples_per_second"], figures[f"{side}-fp32"]["samples_per_second"]
            )
            for side in ("raypar", "plain")
        },
        "raypar_over_plain_bf16": ratio(
            figures["raypar-bf16"]["samples_per_second"], figures["plain-bf16"]["samples_per_second"]
        ),
        # how closely bf16 tracks fp32: the same steps, the final loss's ratio (the curves below)
        "raypar_bf16_over_fp32_final_loss": ratio(
            figures["raypar-bf16"]["final_loss"], figures["raypar-fp32"]["final_loss"]
        ),
        "loss_curves": curves,
        "raw": raw,
    }


def run_gpu_pipeline(bench: Bench, schedule: str, num_stages: int, gpus_per_stage: float) -> dict[str, Any]:
    from ray_jobs.pipeline import trainer as pipeline

    work, m = bench.suite.pipeline, bench.suite.target_microbatches
    cfg = bench.config(work, bench.pipeline_data, f"gpu-pipe-{schedule}")
    scaling = pipeline.PipelineScaling(
        num_stages=num_stages, num_microbatches=m, schedule=schedule, use_gpu=True, gpus_per_stage=gpus_per_stage
    )
    prepared = prepare(cfg, "pipeline")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*the pipeline can never fill.*")
        summary = pipeline.run(prepared, scaling)
    bench.clean(prepared.run_dir)
    return {
        "samples_per_second": steady(summary.extra["epoch_seconds"], work.samples_per_epoch),
        "transport": summary.extra["transport"],
        "final_loss": summary.losses[-1],
    }


def gpu_pipeline_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    """Two stages, each on a GPU of its own, or sharing the one GPU (``--gpus-per-stage 0.5``, p2p)."""
    suite = bench.suite
    gpus = require_gpus()
    num_stages = suite.num_stages
    gpus_per_stage = 1.0 if gpus >= num_stages else 1.0 / num_stages
    raw: dict[str, list[dict]] = {schedule: [] for schedule in GPU_SCHEDULES}
    bench.log("[bench] warm-up (discarded): one GPU pipeline run")
    run_gpu_pipeline(bench, "gpipe", num_stages, gpus_per_stage)
    for rep in range(suite.pipeline_target_repetitions):
        for schedule in GPU_SCHEDULES:
            bench.measure(
                raw[schedule],
                f"GPU pipeline S={num_stages} {schedule}",
                rep,
                lambda s=schedule: run_gpu_pipeline(bench, s, num_stages, gpus_per_stage),
            )
    figures = {key: summarise(runs, text=("transport",)) for key, runs in raw.items()}
    sequential = figures["sequential"]["samples_per_second"]
    return {
        "workload": asdict(suite.pipeline),
        "num_stages": num_stages,
        "gpus_per_stage": gpus_per_stage,
        "num_microbatches": suite.target_microbatches,
        "rows": [
            {
                "schedule": s,
                "transport": figures[s]["transport"],
                "samples_per_second": figures[s]["samples_per_second"],
                "over_sequential": ratio(figures[s]["samples_per_second"], sequential),
            }
            for s in GPU_SCHEDULES
        ],
        "raw": raw,
    }


GPU_CASES = {
    "gpu_data_parallel": gpu_data_parallel_case,
    "gpu_precision": gpu_precision_case,
    "gpu_pipeline": gpu_pipeline_case,
}
