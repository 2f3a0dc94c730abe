"""What every case uses: the bench run's state (suite, data files, scratch storage, each run's CPU
steal), one repetition's measurement, and one run of the plain-torch peer, which both the DDP
and the pipeline cases compare with."""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

from ray_jobs.bench.peer import torch_ddp
from ray_jobs.bench.stats import quiet, steady
from ray_jobs.bench.suites import LmWorkload, Suite, Workload
from ray_jobs.core.config import TrainConfig, WorkerScaling
from ray_jobs.data.parquet import synthesize, write_table
from ray_jobs.driver.prepare import prepare
from ray_jobs.observability.process_stats import cpu_times, steal_fraction


def ray_worker_niceness() -> int:
    """The scheduling niceness of the cluster's worker processes (raypar's DDP workers and stage
    actors): Ray's raylet starts them at 15 on Linux (``RAY_worker_niceness``). The plain-torch
    peers take the same, so that other work on the machine takes as much CPU from either side;
    on an idle machine niceness changes nothing."""
    import ray

    return ray.get(ray.remote(num_cpus=0)(_niceness).remote())


def _niceness() -> int:
    return os.nice(0)


class Bench:
    """One bench run: its suite, data files, scratch storage, and everything measured."""

    def __init__(self, suite: Suite, out: str, storage_path: str, log: Callable[[str], None] = print) -> None:
        self.suite, self.out, self.storage_path, self.log = suite, out, storage_path, log
        self.runs = 0
        self.niceness = ray_worker_niceness()
        self.steal: list[dict[str, Any]] = []  # per measured run: the hypervisor's share of the CPU
        self.ddp_data = os.path.join(out, "data", "ddp.parquet")
        self.pipeline_data = os.path.join(out, "data", "pipeline.parquet")
        self.memory_data = os.path.join(out, "data", "memory.parquet")
        for path, work in (
            (self.ddp_data, suite.ddp),
            (self.pipeline_data, suite.pipeline),
            (self.memory_data, suite.memory),
        ):
            write_table(synthesize(work.rows, work.in_features, work.out_features, "regression", seed=0), path)

    def config(self, work: Workload | LmWorkload, data: str, label: str) -> TrainConfig:
        return work.config(data, self.storage_path, self.run_name(label))

    def run_name(self, label: str) -> str:
        """A new run's ``--name``: this bench process's, numbered, labelled."""
        self.runs += 1
        return f"bench-{os.getpid()}-{self.runs:03d}-{label}"

    def fit_workers(self, cfg: TrainConfig, strategy: str, num_workers: int, use_gpu: bool = False):
        """``cfg`` trained by ddp or fsdp on ``num_workers`` Ray Train workers (a GPU each with
        ``use_gpu``), its run directory removed after; the run's ``TrainSummary``."""
        from ray_jobs import ddp
        from ray_jobs.data_parallel import fsdp

        prepared = prepare(cfg, strategy)
        if strategy == "fsdp":
            summary = fsdp.run(prepared, fsdp.ShardedScaling(num_workers=num_workers, use_gpu=use_gpu))
        else:
            summary = ddp.run(prepared, WorkerScaling(num_workers=num_workers, use_gpu=use_gpu))
        self.clean(prepared.run_dir)
        return summary

    def peer(
        self,
        work: Workload | LmWorkload,
        data: str,
        world_size: int,
        num_threads: int,
        device: str = "cpu",
        precision: str = "fp32",
    ) -> dict[str, Any]:
        cfg = dataclasses.replace(self.config(work, data, f"torch{world_size}"), precision=precision)
        prepared = prepare(cfg, "torch")
        result = torch_ddp(
            cfg,
            prepared.dataset,
            prepared.initial_state,
            world_size,
            num_threads,
            device=device,
            niceness=self.niceness,
        )
        self.clean(prepared.run_dir)
        return {
            "samples_per_second": steady(result.epoch_seconds, work.samples_per_epoch),
            "samples_per_second_quiet": quiet(result.epoch_seconds, result.epoch_steal, work.samples_per_epoch),
            "wall_s": result.wall_s,
            "loop_s": result.loop_s,
            "startup_s": result.wall_s - result.loop_s,
            "first_step_s": result.first_step_s,
            "after_loop_s": result.wall_s - result.first_step_s - result.loop_s,
            "peak_rss_bytes": max(result.peak_rss_bytes),
            "final_loss": result.losses[-1],
            **({"epoch_losses": result.losses} if device != "cpu" else {}),
        }

    def clean(self, run_dir: str) -> None:
        if "://" not in run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)

    def measure(self, into: list, label: str, rep: int, run: Callable[[], dict]) -> None:
        began, cpu = time.perf_counter(), cpu_times()
        result = run()
        into.append(result)
        result["steal_fraction"] = steal = steal_fraction(cpu, cpu_times())
        if steal is not None:
            self.steal.append({"run": f"{label}, run {rep + 1}", "steal_fraction": steal})
        sps = result.get("samples_per_second")
        sps = statistics.median(sps) if isinstance(sps, list) else sps
        self.log(f"[bench] {label}, run {rep + 1}: {sps:,.0f} samples/s, {time.perf_counter() - began:.1f} s")
