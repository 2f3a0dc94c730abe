"""The DDP cases: raypar's DDP against the plain-torch peer (overhead), DDP over 1, 2, 4, ...
workers (scaling), and DataParallel against DDP on one node."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import asdict
from typing import Any

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.stats import quiet, quiet_ratio, ratio, steady, summarise
from ray_jobs.bench.suites import LmWorkload, Workload
from ray_jobs.core.config import WorkerScaling
from ray_jobs.driver.prepare import prepare


def raypar_data_parallel(
    bench: Bench,
    strategy: str,
    num_workers: int,
    epochs: int | None = None,
    use_gpu: bool = False,
    precision: str = "fp32",
    *,
    work: Workload | LmWorkload | None = None,
    data: str | None = None,
    grad_accum_steps: int = 1,
    compile: bool = False,
) -> dict[str, Any]:
    """One DDP (or DataParallel, on ``num_workers`` CPUs, or GPUs with ``use_gpu``) fit of ``work``
    on ``data`` (by default the suite's DDP workload and data); start-up is wall minus loop time.
    With ``use_gpu``, also the per-epoch losses."""
    from ray_jobs import ddp, dp

    work, data = work or bench.suite.ddp, data or bench.ddp_data
    label = (
        f"{strategy}{num_workers}{'-gpu' if use_gpu else ''}{f'-k{grad_accum_steps}' if grad_accum_steps > 1 else ''}"
        f"{'-compiled' if compile else ''}"
    )
    cfg = bench.config(work, data, label)
    cfg = dataclasses.replace(cfg, precision=precision, grad_accum_steps=grad_accum_steps, compile=compile)
    if epochs is not None:
        cfg = dataclasses.replace(cfg, epochs=epochs, checkpoint_every=epochs)
    prepared = prepare(cfg, strategy)
    began, began_at = time.perf_counter(), time.time()  # wall clock, as the workers' first step
    if strategy == "ddp":
        summary = ddp.run(prepared, WorkerScaling(num_workers=num_workers, use_gpu=use_gpu))
    elif use_gpu:
        summary = dp.run(prepared, dp.DataParallelScaling(gpus=num_workers))
    else:
        summary = dp.run(prepared, dp.DataParallelScaling(cpus_per_worker=float(num_workers)))
    wall = time.perf_counter() - began
    epochs, samples_per_epoch = summary.extra["epoch_seconds"], work.samples_per_epoch
    bench.clean(prepared.run_dir)
    return {
        "samples_per_second": steady(epochs, samples_per_epoch),
        "samples_per_second_quiet": quiet(epochs, summary.extra["epoch_steal"], samples_per_epoch),
        "wall_s": wall,
        "loop_s": sum(epochs),
        "startup_s": wall - sum(epochs),
        "first_step_s": summary.extra["first_step_at"] - began_at,
        "after_loop_s": wall - (summary.extra["first_step_at"] - began_at) - sum(epochs),
        # What the first epoch takes beyond a steady one: warm-up, and with --compile the compiling.
        "first_epoch_excess_s": epochs[0] - statistics.median(epochs[1:]) if len(epochs) > 1 else None,
        "peak_rss_bytes": max(summary.extra["worker_peak_rss_bytes"]),
        "final_loss": summary.losses[-1],
        **({"epoch_losses": summary.losses} if use_gpu else {}),
    }  # the GPU cases compare loss curves


def max_workers() -> int:
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def largest_node_cpus() -> int:
    import ray

    return max(int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive"))


def worker_counts(max_workers: int, batch_size: int) -> list[int]:
    """1, 2, 4, ... up to ``max_workers`` (and ``max_workers`` itself), dividing the global batch."""
    counts, n = [], 1
    while n <= max_workers:
        counts.append(n)
        n *= 2
    if max_workers not in counts:
        counts.append(max_workers)
    return [n for n in counts if batch_size % n == 0]


def data_parallel_cases(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    """DDP overhead, scaling, and DataParallel vs DDP, their repetitions interleaved."""
    suite, work = bench.suite, bench.suite.ddp
    cpus = max_workers()
    cap = min(suite.ddp_workers, cpus)
    counts = worker_counts(min(suite.max_workers, cpus), work.batch_size)
    if cap not in counts and work.batch_size % cap == 0:
        counts = sorted(set(counts) | {cap})
    ddp_workers = max(n for n in counts if n <= cap)
    # DataParallel is one worker: it needs all of the DDP workers' CPUs on one node.
    run_dp = ddp_workers <= largest_node_cpus()
    raw: dict[str, list[dict]] = {f"ddp{n}": [] for n in counts}
    raw.update({f"torch{ddp_workers}": [], f"dp{ddp_workers}": []})
    if counts[0] == ddp_workers and suite.warm_ups:
        # Otherwise a smaller fit runs first and pays the cluster's one-time costs (imports,
        # worker processes); only its steady epochs are reported, which exclude the first.
        bench.log("[bench] warm-up (discarded): one 1-epoch DDP fit")
        raypar_data_parallel(bench, "ddp", ddp_workers, epochs=1)
    if suite.warm_ups:
        bench.log("[bench] warm-up (discarded): one plain-torch DDP run")
        bench.peer(work, bench.ddp_data, ddp_workers, 1)
    for rep in range(max(suite.fit_repetitions, suite.overhead_repetitions)):
        for n in counts:
            if rep < (suite.overhead_repetitions if n == ddp_workers else suite.fit_repetitions):
                bench.measure(
                    raw[f"ddp{n}"], f"raypar DDP {n} workers", rep, lambda n=n: raypar_data_parallel(bench, "ddp", n)
                )
            if n == ddp_workers and rep < suite.overhead_repetitions:
                bench.measure(
                    raw[f"torch{n}"],
                    f"torch DDP {n} processes",
                    rep,
                    lambda: bench.peer(work, bench.ddp_data, ddp_workers, 1),
                )
        if rep < suite.fit_repetitions and run_dp:
            bench.measure(
                raw[f"dp{ddp_workers}"],
                f"raypar DataParallel {ddp_workers} CPUs",
                rep,
                lambda: raypar_data_parallel(bench, "dp", ddp_workers),
            )

    figures = {key: summarise(runs) for key, runs in raw.items()}
    ddp_main, peer = figures[f"ddp{ddp_workers}"], figures[f"torch{ddp_workers}"]
    dp_run = figures[f"dp{ddp_workers}"]
    sps1 = figures[f"ddp{counts[0]}"]["samples_per_second"] if counts and counts[0] == 1 else None
    scaling = []
    for n in counts:
        sps = figures[f"ddp{n}"]["samples_per_second"]
        speedup = ratio(sps, sps1) if sps1 else None
        efficiency = {k: v / n for k, v in speedup.items()} if speedup else None
        scaling.append({"num_workers": n, "samples_per_second": sps, "speedup": speedup, "efficiency": efficiency})
    return {
        "workload": asdict(work),
        "ddp_overhead": {
            "num_workers": ddp_workers,
            "raypar": ddp_main,
            "torch": peer,
            "samples_per_second_ratio": ratio(ddp_main["samples_per_second"], peer["samples_per_second"]),
            "quiet_samples_per_second_ratio": quiet_ratio(ddp_main, peer),
            "startup_ratio": ratio(ddp_main["startup_s"], peer["startup_s"]),
            "first_step_ratio": ratio(ddp_main["first_step_s"], peer["first_step_s"]),
            "peak_rss_ratio": ratio(ddp_main["peak_rss_bytes"], peer["peak_rss_bytes"]),
            "raw": {"raypar": raw[f"ddp{ddp_workers}"], "torch": raw[f"torch{ddp_workers}"]},
        },
        "scaling": {"cluster_cpus": cpus, "points": scaling, "raw": {str(n): raw[f"ddp{n}"] for n in counts}},
        "dp_vs_ddp": {
            "num_workers": ddp_workers,
            "ddp": ddp_main,
            "dp": dp_run,
            "ddp_over_dp": ratio(ddp_main["samples_per_second"], dp_run["samples_per_second"]),
            "raw": {"dp": raw[f"dp{ddp_workers}"]},
        }
        if run_dp
        else {"skipped": f"no node has the {ddp_workers} CPUs of one DataParallel worker"},
    }
