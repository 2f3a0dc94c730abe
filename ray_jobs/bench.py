"""Benchmarks: ``python -m ray_jobs.bench --suite quick|full [--out runs/bench] [--address ADDR]``, or
``--render DIR`` to write a finished run's report and plots anew from its ``bench.json``.

Measures raypar's strategies against plain PyTorch peers on the same model, data, global batch
and steps, and writes ``bench.json`` (every repetition), ``bench.md`` (the tables) and, when
matplotlib is installed, PNG plots into ``--out``. Every figure is the median of several
repetitions after a warm-up, with min and max: a throughput's repetitions are the epochs after
the first of each run (the first pays one-time costs), a start-up cost's are the runs. Every
comparison is a ratio of figures measured in the same bench run, the runs of both sides
interleaved.

Cases: DDP overhead (raypar vs torch.multiprocessing + gloo), DDP scaling, the actor pipeline
(schedules, micro-batches, transports, bubble, transfer cost), DataParallel vs DDP, data ingest.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

# Ray is imported inside the functions that need it: the plain-torch peer's spawned processes
# import this module, and importing Ray there would inflate the peer's start-up cost.
from models import build_model
from ray_jobs.config import ArgumentParser, TrainConfig, WorkerScaling
from ray_jobs.data import Dataset, read_dataset, synthesize, write_table
from ray_jobs.runner import prepare
from ray_jobs.schedules import SCHEDULES
from ray_jobs.readings import cpu_times, peak_rss_bytes, steal_fraction
from ray_jobs.training import build_optimizer, epoch_order, global_batches, loss_function, shard, train_step

PEER_TIMEOUT_S = 600.0
THREADS_PER_STAGE = 1  # each stage actor's CPUs and torch threads; also the single-process baseline's
MIB = 1024 * 1024


# ---------------------------------------------------------------------------------------------
# Suites


@dataclass(frozen=True)
class Workload:
    """A model and a synthetic regression dataset (written as Parquet, read back like --data)."""

    model: str
    hidden: int
    depth: int
    rows: int
    in_features: int
    out_features: int
    batch_size: int
    epochs: int

    def config(self, data: str, storage_path: str, name: str) -> TrainConfig:
        # Checkpoint once, at the end: checkpoints are outside the timed loop, but not outside
        # the wall time that start-up cost is derived from.
        return TrainConfig(
            model=self.model, hidden=self.hidden, depth=self.depth, data=data, epochs=self.epochs,
            batch_size=self.batch_size, checkpoint_every=self.epochs, num_checkpoints_to_keep=1,
            storage_path=storage_path, name=name,
        )

    @property
    def steps_per_epoch(self) -> int:
        return self.rows // self.batch_size

    @property
    def samples_per_epoch(self) -> int:
        return self.steps_per_epoch * self.batch_size


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    ddp: Workload
    pipeline: Workload
    fit_repetitions: int
    """Repetitions of each Ray Train fit (DDP, DataParallel): ~15 s of fixed cost each."""
    overhead_repetitions: int
    """Repetitions of the DDP-overhead pair (raypar DDP and the torch peer), the headline ratio."""
    cheap_repetitions: int
    """Repetitions of the plain-torch peers and of ingest (seconds each)."""
    pipeline_repetitions: int
    """Runs of each pipeline configuration."""
    pipeline_target_repetitions: int
    """Runs of the configurations the targets judge (M = ``target_microbatches``): with both
    cores computing, Ray's own processes preempt a stage now and then, so runs differ more than
    the epochs within one run."""
    ddp_workers: int
    """Workers of the DDP-overhead and DataParallel-vs-DDP cases (capped by the cluster's CPUs)."""
    max_workers: int
    """Largest worker count of the scaling case (capped by the cluster's CPUs)."""
    num_stages: int
    microbatches: tuple[int, ...]
    target_microbatches: int
    """M of the pipeline targets, and of the transport comparison."""
    other_transport_schedules: tuple[str, ...]
    """Schedules also run over the other transports (compiled graph, plain actor calls), at every M
    of ``other_transport_microbatches``."""
    other_transport_microbatches: tuple[int, ...]
    ingest_repetitions: int


SUITES: dict[str, Suite] = {
    "quick": Suite(
        name="quick",
        description="a few minutes on a 2-core machine",
        # 256 rows per worker and step: enough compute that gloo's all-reduce does not dominate.
        ddp=Workload("mlp", 256, 4, rows=32768, in_features=32, out_features=8, batch_size=512, epochs=5),
        pipeline=Workload("mlp", 1024, 8, rows=2048, in_features=1024, out_features=1024, batch_size=256, epochs=3),
        # Each run's epochs after the first are its repetitions: one Ray Train fit costs ~15 s of
        # start-up here, so repeating runs is kept for the start-up figure.
        fit_repetitions=1,
        overhead_repetitions=2,
        cheap_repetitions=3,
        pipeline_repetitions=1,
        pipeline_target_repetitions=3,
        ddp_workers=2,
        max_workers=2,
        num_stages=2,
        microbatches=(1, 2, 4, 8, 16),
        target_microbatches=8,
        other_transport_schedules=("gpipe",),
        other_transport_microbatches=(8,),
        ingest_repetitions=5,
    ),
    "full": Suite(
        name="full",
        description="a real cluster: more data, workers up to the cluster's CPUs, 5 repetitions",
        ddp=Workload("mlp", 1024, 4, rows=65536, in_features=256, out_features=16, batch_size=512, epochs=5),
        pipeline=Workload("mlp", 1024, 8, rows=8192, in_features=1024, out_features=1024, batch_size=256, epochs=5),
        fit_repetitions=5,
        overhead_repetitions=5,
        cheap_repetitions=5,
        pipeline_repetitions=5,
        pipeline_target_repetitions=5,
        ddp_workers=4,
        max_workers=64,
        num_stages=2,
        microbatches=(1, 2, 4, 8, 16),
        target_microbatches=8,
        other_transport_schedules=("gpipe", "1f1b", "sequential"),
        other_transport_microbatches=(1, 2, 4, 8, 16),
        ingest_repetitions=10,
    ),
    "smoke": Suite(
        name="smoke",
        description="seconds-scale check that the bench itself runs; its numbers mean nothing",
        ddp=Workload("mlp", 32, 3, rows=512, in_features=8, out_features=4, batch_size=64, epochs=2),
        pipeline=Workload("mlp", 64, 4, rows=256, in_features=64, out_features=64, batch_size=64, epochs=2),
        fit_repetitions=1,
        overhead_repetitions=1,
        cheap_repetitions=1,
        pipeline_repetitions=1,
        pipeline_target_repetitions=1,
        ddp_workers=2,
        max_workers=2,
        num_stages=2,
        microbatches=(1, 4),
        target_microbatches=4,
        other_transport_schedules=("gpipe",),
        other_transport_microbatches=(4,),
        ingest_repetitions=2,
    ),
}

# The targets on a CPU machine with gloo: reported, never asserted.
TARGET_DDP_RATIO = 0.97
# An epoch is quiet at or below this steal: /proc/stat counts 10 ms ticks, so a ~0.6 s epoch on
# 2 vCPUs resolves ~1%, and 1 s windows on this VM read 0-1% idle but up to ~7% while spinning.
QUIET_STEAL = 0.03
# The DDP ratio is judged on quiet epochs only when each side has at least this many.
MIN_QUIET_EPOCHS = 2
TARGET_PIPELINE_SPEEDUP = 1.6
TARGET_BUBBLE_POINTS = 0.05
TARGET_INGEST_RATIO = 5.0


# ---------------------------------------------------------------------------------------------
# Statistics and theory


def stats(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of the repetitions, with the repetitions themselves."""
    if not values:
        raise ValueError("no repetitions to summarise")
    values = [float(v) for v in values]
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def after_warmup(epochs: Sequence) -> Sequence:
    """A run's epochs after the first, which pays one-time costs (allocations, the first gloo
    exchanges, caches); these are the run's repetitions. One epoch: that epoch."""
    return epochs[1:] or epochs


def steady(epoch_seconds: Sequence[float], samples_per_epoch: int) -> list[float]:
    """Samples/s of each epoch ``after_warmup``."""
    return [samples_per_epoch / seconds for seconds in after_warmup(epoch_seconds)]


def quiet(epoch_seconds: Sequence[float], epoch_steal: Sequence[float | None] | None,
          samples_per_epoch: int) -> list[float]:
    """Samples/s of the ``steady`` epochs the hypervisor took at most ``QUIET_STEAL`` of the CPU
    from: what the code does when the host leaves it alone (steal is never negative noise)."""
    steal = after_warmup(epoch_steal or [None] * len(epoch_seconds))
    rates = steady(epoch_seconds, samples_per_epoch)
    return [sps for sps, s in zip(rates, steal) if s is not None and s <= QUIET_STEAL]


def ratio(numerator: dict[str, Any], denominator: dict[str, Any]) -> dict[str, Any]:
    """Ratio of two figures' medians; min and max are the least and most favourable pairings."""
    return {
        "median": numerator["median"] / denominator["median"],
        "min": numerator["min"] / denominator["max"],
        "max": numerator["max"] / denominator["min"],
    }


def quiet_ratio(numerator: dict[str, Any], denominator: dict[str, Any]) -> dict[str, Any] | None:
    """``ratio`` of two summaries' quiet samples/s, when each has ``MIN_QUIET_EPOCHS``."""
    quiet_figures = [f.get("samples_per_second_quiet") for f in (numerator, denominator)]
    if any(f is None or len(f["values"]) < MIN_QUIET_EPOCHS for f in quiet_figures):
        return None
    return ratio(*quiet_figures)


def gpipe_bubble(num_stages: int, num_microbatches: int) -> float:
    """GPipe's idle fraction of each stage, (S-1)/(M+S-1), with equal stages and free transfers."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got S={num_stages}, M={num_microbatches}")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def transfer_overhead_us(step_seconds: float, critical_seconds: float, num_stages: int, num_microbatches: int) -> float:
    """Wall time of a no-overlap step not on its compute critical path, per activation or gradient transfer.

    A step moves each micro-batch's activation forward and its gradient back across every cut:
    2 (S-1) M transfers. The uncovered time also holds the driver's dispatch and any later
    stage's optimizer step that outlasts the backward it overlaps, so this is an upper bound.
    """
    transfers = 2 * (num_stages - 1) * num_microbatches
    return 1e6 * (step_seconds - critical_seconds) / transfers if transfers else float("nan")


def sequential_critical_fraction(fractions: dict[str, Any]) -> float:
    """Share of a no-overlap step's wall time that its compute critical path takes: every stage's
    forward and backward plus the first stage's optimizer step. Each later stage steps while the
    gradient travels back upstream (measured: counting those steps too made the transfer cost
    negative at M = 1 and 2)."""
    return sum(fractions["compute_by_stage"]) + fractions["optimizer_by_stage"][0]


def stage_balance(fractions: dict[str, Any]) -> tuple[float, float]:
    """The idle share of the busiest stage (the most compute and optimizer time), which sets the
    pace, and its busy time over the least busy stage's. With uneven stages the others idle more
    than the schedule alone makes them: the mean bubble's excess over the busiest stage's."""
    busy = [c + o for c, o in zip(fractions["compute_by_stage"], fractions["optimizer_by_stage"])]
    return 1.0 - max(busy), max(busy) / min(busy)


def speedup_parts(row: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any] | None:
    """A pipeline's speed-up over its no-overlap baseline as the product of two ratios, each of
    epoch figures measured in the same runs: ``busy_share``, the stages' busy share (1 - bubble)
    over the baseline's, which is what the schedule overlaps; and ``op_speed``, samples per
    second of busy stage time over the baseline's, which is how fast the ops themselves ran (two
    stages computing at once, or a slow phase of the host, slow them; no schedule controls that).
    None when a row lacks per-epoch bubbles to pair with its rates."""
    def per_epoch(figures: dict[str, Any]) -> tuple[dict, dict] | None:
        rates, bubbles = figures["samples_per_second"]["values"], figures["bubble_fraction"].get("values")
        if not bubbles or len(bubbles) != len(rates) or max(bubbles) >= 1:
            return None
        return (stats([1.0 - b for b in bubbles]),
                stats([rate / (1.0 - b) for rate, b in zip(rates, bubbles)]))

    pipelined, sequential = per_epoch(row), per_epoch(baseline)
    if pipelined is None or sequential is None:
        return None
    return {"busy_share": ratio(pipelined[0], sequential[0]), "op_speed": ratio(pipelined[1], sequential[1])}


def target(name: str, measured: dict[str, Any] | None, goal: str, met: Callable[[float], bool], unit: str = "") -> dict:
    """A target judged on the median and the range around it: ``met`` or ``missed`` only when
    the median, min and max agree, else ``within noise`` (a median of 1.65x whose range is
    0.88-2.73x says nothing about a 0.97x goal). ``measured`` None: the case did not run."""
    if measured is None:
        return {"name": name, "goal": goal, "measured": None, "status": "not run"}
    verdicts = {met(measured[k]) for k in ("median", "min", "max")}
    status = "within noise" if len(verdicts) > 1 else "met" if verdicts == {True} else "missed"
    return {"name": name, "goal": goal, "measured": measured, "unit": unit, "status": status}


# ---------------------------------------------------------------------------------------------
# Tables


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)} has {len(row)} cells, the table has {len(headers)} columns")
    # a column is numeric when every cell is a number or "-" (not measured), and one is a number
    numeric = [all(_looks_numeric(row[i]) or str(row[i]) == "-" for row in rows)
               and any(_looks_numeric(row[i]) for row in rows) for i in range(len(headers))]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _looks_numeric(value: Any) -> bool:
    text = str(value).strip()
    return bool(text) and text != "-" and (text[0].isdigit() or text[0] in "-+.")


def fmt(figure: dict[str, Any] | None, spec: str = ",.0f", scale: float = 1.0) -> str:
    """``median (min–max)``, or ``-`` for a figure that was not measured."""
    if figure is None:
        return "-"
    median, low, high = (scale * figure[k] for k in ("median", "min", "max"))
    if f"{low:{spec}}" == f"{high:{spec}}":
        return f"{median:{spec}}"
    return f"{median:{spec}} ({low:{spec}}–{high:{spec}})"


# ---------------------------------------------------------------------------------------------
# The plain-torch peers: torch.multiprocessing.spawn + gloo (or one process), no Ray


@dataclass
class PeerResult:
    """One run of plain PyTorch over the same training contract as raypar."""

    world_size: int
    num_threads: int
    samples_per_second: float
    """Samples over seconds inside the epoch loops, as raypar's loop measures it."""
    first_step_s: float
    """From the call that starts the processes to world rank 0's first step."""
    wall_s: float
    """From the call that starts the processes until all have exited."""
    loop_s: float
    epoch_seconds: list[float]
    epoch_steal: list[float | None]
    """CPU steal of each epoch, as raypar's loop records it."""
    losses: list[float]
    state: dict[str, torch.Tensor] = field(repr=False)
    peak_rss_bytes: list[int]
    """Peak resident memory of each process (VmHWM)."""


def torch_ddp(
    cfg: TrainConfig,
    dataset: Dataset,
    initial_state: dict[str, torch.Tensor],
    world_size: int,
    num_threads: int = 1,
    timeout_s: float = PEER_TIMEOUT_S,
) -> PeerResult:
    """Train with plain torch.distributed DDP: ``world_size`` processes from
    ``torch.multiprocessing.spawn``, gloo on 127.0.0.1; one process and no DDP when 1."""
    with tempfile.TemporaryDirectory(prefix="raypar-bench-peer-") as directory:
        began = time.time()
        context = mp.spawn(
            _peer_worker,
            args=(world_size, asdict(cfg), dataset, initial_state, num_threads, directory, timeout_s),
            nprocs=world_size,
            join=False,
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                raise TimeoutError(f"the plain-torch peer ({world_size} processes) did not finish in {timeout_s:.0f} s")
        wall = time.time() - began
        ranks = [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    rank0 = ranks[0]
    return PeerResult(
        world_size=world_size,
        num_threads=num_threads,
        samples_per_second=rank0["samples"] / sum(rank0["epoch_seconds"]),
        first_step_s=rank0["first_step_at"] - began,
        wall_s=wall,
        loop_s=sum(rank0["epoch_seconds"]),
        epoch_seconds=rank0["epoch_seconds"],
        epoch_steal=rank0["epoch_steal"],
        losses=rank0["losses"],
        state=rank0["state"],
        peak_rss_bytes=[r["peak_rss_bytes"] for r in ranks],
    )


def _peer_worker(
    world_rank: int, world_size: int, train: dict[str, Any], dataset: Dataset,
    initial_state: dict[str, torch.Tensor], num_threads: int, directory: str, timeout_s: float,
) -> None:
    """The DDP tutorial's worker over raypar's training contract: what raypar's loop does, minus Ray."""
    cfg = TrainConfig(**train)
    torch.set_num_threads(num_threads)
    if world_size > 1:
        # The tutorial's MASTER_PORT would need a port picked free in advance, which another
        # process can take before rank 0 binds it; a file store in the run's folder cannot race.
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(directory, 'store')}", rank=world_rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    model = build_model(cfg.model, dataset.in_features, dataset.out_features, **cfg.model_options)
    model.load_state_dict(initial_state)
    optimizer = build_optimizer(model.parameters(), cfg)
    wrapped = DistributedDataParallel(model) if world_size > 1 else model
    features, targets = dataset.tensors()
    loss_fn = loss_function(dataset.task)

    first_step_at, losses, samples, epoch_seconds, epoch_steal = None, [], 0, [], []
    for epoch in range(cfg.epochs):
        began, cpu = time.perf_counter(), cpu_times()
        batches = global_batches(epoch_order(dataset.num_rows, cfg.seed, epoch, cfg.shuffle), cfg.batch_size)
        step_losses = torch.zeros(len(batches))
        for step, batch in enumerate(batches):
            if first_step_at is None:
                first_step_at = time.time()
            rows = shard(batch, world_size, world_rank)
            step_losses[step] = train_step(wrapped, optimizer, loss_fn, features[rows], targets[rows])
        # raypar's loop also all-reduces the step losses once per epoch, inside its timing.
        if world_size > 1:
            dist.all_reduce(step_losses)
            step_losses = step_losses / world_size
        losses.append(sum(step_losses.tolist()) / len(batches))
        epoch_seconds.append(time.perf_counter() - began)
        epoch_steal.append(steal_fraction(cpu, cpu_times()))
        samples += len(batches) * cfg.batch_size
    result = {"first_step_at": first_step_at, "losses": losses, "samples": samples, "epoch_seconds": epoch_seconds,
              "epoch_steal": epoch_steal,
              "peak_rss_bytes": peak_rss_bytes()}
    if world_rank == 0:
        result["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(result, os.path.join(directory, f"rank{world_rank}.pt"))
    if world_size > 1:
        # Leave together: a rank tearing gloo down while its peer is still saving can abort it.
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Data ingest, run inside a Ray worker


def measure_ingest(path: str, batch_size: int, seed: int, repetitions: int) -> dict[str, Any]:
    """Rows/s from Parquet to training batches, and from Parquet to an Arrow table with pyarrow alone.

    raypar: ``read_dataset`` (read + validate) then one epoch of the loop's indexing, every
    global batch. The first repetition warms the page cache and is dropped.
    """
    rss_at_start = peak_rss_bytes()
    raypar_s, pyarrow_s = [], []
    num_rows = 0
    for _ in range(repetitions + 1):
        began = time.perf_counter()
        table = pq.read_table(path)
        pyarrow_s.append(time.perf_counter() - began)
        num_rows = table.num_rows
        del table

        began = time.perf_counter()
        dataset = read_dataset(path)
        features, targets = dataset.tensors()
        for batch in global_batches(epoch_order(dataset.num_rows, seed, 0, True), batch_size):
            rows = shard(batch, 1, 0)
            features[rows], targets[rows]
        raypar_s.append(time.perf_counter() - began)
        del dataset, features, targets
    return {
        "rows": num_rows,
        "batched_rows": (num_rows // batch_size) * batch_size,
        "raypar_seconds": raypar_s[1:],
        "pyarrow_seconds": pyarrow_s[1:],
        "rss_at_start_bytes": rss_at_start,
        "peak_rss_bytes": peak_rss_bytes(),
    }


# ---------------------------------------------------------------------------------------------
# The bench run


class Bench:
    """One bench run: its suite, data files, scratch storage, and everything measured."""

    def __init__(self, suite: Suite, out: str, storage_path: str, log: Callable[[str], None] = print) -> None:
        self.suite, self.out, self.storage_path, self.log = suite, out, storage_path, log
        self.runs = 0
        self.steal: list[dict[str, Any]] = []  # per measured run: the hypervisor's share of the CPU
        self.ddp_data = os.path.join(out, "data", "ddp.parquet")
        self.pipeline_data = os.path.join(out, "data", "pipeline.parquet")
        for path, work in ((self.ddp_data, suite.ddp), (self.pipeline_data, suite.pipeline)):
            write_table(synthesize(work.rows, work.in_features, work.out_features, "regression", seed=0), path)

    def config(self, work: Workload, data: str, label: str) -> TrainConfig:
        self.runs += 1
        return work.config(data, self.storage_path, f"bench-{os.getpid()}-{self.runs:03d}-{label}")

    # -- one measurement each ---------------------------------------------------------------

    def raypar_data_parallel(self, strategy: str, num_workers: int, epochs: int | None = None) -> dict[str, Any]:
        """One DDP (or DataParallel, on ``num_workers`` CPUs) fit; start-up is wall minus loop time."""
        from ray_jobs import ddp, dp

        cfg = self.config(self.suite.ddp, self.ddp_data, f"{strategy}{num_workers}")
        if epochs is not None:
            cfg = dataclasses.replace(cfg, epochs=epochs, checkpoint_every=epochs)
        prepared = prepare(cfg, strategy)
        began, began_at = time.perf_counter(), time.time()  # wall clock, as the workers' first step
        if strategy == "ddp":
            summary = ddp.run(prepared, WorkerScaling(num_workers=num_workers))
        else:
            summary = dp.run(prepared, dp.DataParallelScaling(cpus_per_worker=float(num_workers)))
        wall = time.perf_counter() - began
        epochs, samples_per_epoch = summary.extra["epoch_seconds"], self.suite.ddp.samples_per_epoch
        self._clean(prepared.run_dir)
        return {"samples_per_second": steady(epochs, samples_per_epoch),
                "samples_per_second_quiet": quiet(epochs, summary.extra["epoch_steal"], samples_per_epoch),
                "wall_s": wall, "loop_s": sum(epochs), "startup_s": wall - sum(epochs),
                "first_step_s": summary.extra["first_step_at"] - began_at,
                "after_loop_s": wall - (summary.extra["first_step_at"] - began_at) - sum(epochs),
                "peak_rss_bytes": max(summary.extra["worker_peak_rss_bytes"]), "final_loss": summary.losses[-1]}

    def peer(self, work: Workload, data: str, world_size: int, num_threads: int) -> dict[str, Any]:
        cfg = self.config(work, data, f"torch{world_size}")
        prepared = prepare(cfg, "torch")
        result = torch_ddp(cfg, prepared.dataset, prepared.initial_state, world_size, num_threads)
        self._clean(prepared.run_dir)
        return {"samples_per_second": steady(result.epoch_seconds, work.samples_per_epoch),
                "samples_per_second_quiet": quiet(result.epoch_seconds, result.epoch_steal, work.samples_per_epoch),
                "wall_s": result.wall_s, "loop_s": result.loop_s,
                "startup_s": result.wall_s - result.loop_s, "first_step_s": result.first_step_s,
                "after_loop_s": result.wall_s - result.first_step_s - result.loop_s,
                "peak_rss_bytes": max(result.peak_rss_bytes), "final_loss": result.losses[-1]}

    def pipeline(self, schedule: str, num_microbatches: int, transport: str) -> dict[str, Any]:
        from ray_jobs import pipeline

        cfg = self.config(self.suite.pipeline, self.pipeline_data, f"pipe-{schedule}-{num_microbatches}-{transport}")
        scaling = pipeline.PipelineScaling(num_stages=self.suite.num_stages, num_microbatches=num_microbatches,
                                           schedule=schedule, transport=transport,
                                           cpus_per_stage=float(THREADS_PER_STAGE))
        prepared = prepare(cfg, "pipeline")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*the pipeline can never fill.*")
            summary = pipeline.run(prepared, scaling)
        self._clean(prepared.run_dir)
        work, num_stages = self.suite.pipeline, self.suite.num_stages
        timed = after_warmup(list(zip(summary.extra["epoch_seconds"], summary.extra["epoch_stage_time_fractions"])))
        step_s = [seconds / work.steps_per_epoch for seconds, _ in timed]
        result = {"samples_per_second": steady(summary.extra["epoch_seconds"], work.samples_per_epoch),
                  "bubble_fraction": [f["bubble"] for _, f in timed],
                  "transport": summary.extra["transport"], "step_s": step_s}
        if schedule == "sequential":  # only there does no compute overlap, so the rest is transfer
            critical_s = [sequential_critical_fraction(f) * step for step, (_, f) in zip(step_s, timed)]
            result["critical_s"] = critical_s
            result["transfer_us"] = [transfer_overhead_us(step, critical, num_stages, num_microbatches)
                                     for step, critical in zip(step_s, critical_s)]
        for key in TIME_SHARES:
            result[f"{key}_fraction"] = [f.get(key, 0.0) for _, f in timed]
        result["schedule_bubble"] = [f["schedule_bubble"] for _, f in timed]
        result["median_ops_bubble"] = [f["median_ops_bubble"] for _, f in timed]
        balance = [stage_balance(f) for _, f in timed]
        result["busiest_stage_bubble"] = [bubble for bubble, _ in balance]
        result["stage_imbalance"] = [imbalance for _, imbalance in balance]
        return result

    def ingest(self) -> dict[str, Any]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # A fresh worker (its own peak RSS) on this node, where the bench wrote the Parquet file.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        task = ray.remote(num_cpus=1, max_calls=1, scheduling_strategy=here)(measure_ingest)
        return ray.get(task.remote(self.ddp_data, self.suite.ddp.batch_size, 0, self.suite.ingest_repetitions),
                       timeout=PEER_TIMEOUT_S)

    def _clean(self, run_dir: str) -> None:
        if "://" not in run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)

    # -- the cases ----------------------------------------------------------------------------

    def max_workers(self) -> int:
        import ray

        return max(1, int(ray.cluster_resources().get("CPU", 1)))

    def largest_node_cpus(self) -> int:
        import ray

        return max(int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node.get("Alive"))

    def data_parallel_cases(self) -> dict[str, Any]:
        """DDP overhead, scaling, and DataParallel vs DDP, their repetitions interleaved."""
        suite, work = self.suite, self.suite.ddp
        cpus = self.max_workers()
        cap = min(suite.ddp_workers, cpus)
        counts = worker_counts(min(suite.max_workers, cpus), work.batch_size)
        if cap not in counts and work.batch_size % cap == 0:
            counts = sorted(set(counts) | {cap})
        ddp_workers = max(n for n in counts if n <= cap)
        # DataParallel is one worker: it needs all of the DDP workers' CPUs on one node.
        run_dp = ddp_workers <= self.largest_node_cpus()
        raw: dict[str, list[dict]] = {f"ddp{n}": [] for n in counts}
        raw.update({f"torch{ddp_workers}": [], f"dp{ddp_workers}": []})
        if counts[0] == ddp_workers:
            # Otherwise a smaller fit runs first and pays the cluster's one-time costs (imports,
            # worker processes); only its steady epochs are reported, which exclude the first.
            self.log("[bench] warm-up (discarded): one 1-epoch DDP fit")
            self.raypar_data_parallel("ddp", ddp_workers, epochs=1)
        self.log("[bench] warm-up (discarded): one plain-torch DDP run")
        self.peer(work, self.ddp_data, ddp_workers, 1)
        for rep in range(max(suite.fit_repetitions, suite.overhead_repetitions)):
            for n in counts:
                if rep < (suite.overhead_repetitions if n == ddp_workers else suite.fit_repetitions):
                    self._measure(raw[f"ddp{n}"], f"raypar DDP {n} workers", rep,
                                  lambda n=n: self.raypar_data_parallel("ddp", n))
                if n == ddp_workers and rep < suite.overhead_repetitions:
                    self._measure(raw[f"torch{n}"], f"torch DDP {n} processes", rep,
                                  lambda: self.peer(work, self.ddp_data, ddp_workers, 1))
            if rep < suite.fit_repetitions and run_dp:
                self._measure(raw[f"dp{ddp_workers}"], f"raypar DataParallel {ddp_workers} CPUs", rep,
                              lambda: self.raypar_data_parallel("dp", ddp_workers))

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
            "scaling": {"cluster_cpus": cpus, "points": scaling,
                        "raw": {str(n): raw[f"ddp{n}"] for n in counts}},
            "dp_vs_ddp": {
                "num_workers": ddp_workers,
                "ddp": ddp_main,
                "dp": dp_run,
                "ddp_over_dp": ratio(ddp_main["samples_per_second"], dp_run["samples_per_second"]),
                "raw": {"dp": raw[f"dp{ddp_workers}"]},
            } if run_dp else {"skipped": f"no node has the {ddp_workers} CPUs of one DataParallel worker"},
        }

    def pipeline_case(self) -> dict[str, Any]:
        suite, work = self.suite, self.suite.pipeline
        wanted = [(schedule, m, PIPELINE_TRANSPORT) for m in suite.microbatches for schedule in PIPELINE_SCHEDULES]
        wanted += [(schedule, m, transport) for m in suite.other_transport_microbatches
                   for schedule in suite.other_transport_schedules for transport in OTHER_TRANSPORTS]
        same_as = {c: same_ops_as(c[0], suite.num_stages, c[1]) for c in wanted}
        configs = [c for c in wanted if same_as[c] == c[0]]  # run each distinct op order once
        raw: dict[tuple, list[dict]] = {c: [] for c in configs}
        single: list[dict] = []
        self.log("[bench] warm-up (discarded): one pipeline run, one single-process run")
        self.pipeline("gpipe", suite.target_microbatches, PIPELINE_TRANSPORT)
        self.peer(work, self.pipeline_data, 1, THREADS_PER_STAGE)
        for rep in range(max(suite.pipeline_repetitions, suite.pipeline_target_repetitions)):
            if rep < suite.cheap_repetitions:
                self._measure(single, "single process, whole model", rep,
                              lambda: self.peer(work, self.pipeline_data, 1, THREADS_PER_STAGE))
            for config in configs:
                schedule, m, transport = config
                judged = m == suite.target_microbatches and transport == PIPELINE_TRANSPORT
                if rep >= (suite.pipeline_target_repetitions if judged else suite.pipeline_repetitions):
                    continue
                self._measure(raw[config], f"pipeline S={suite.num_stages} M={m} {schedule} {transport}", rep,
                              lambda config=config: self.pipeline(*config))
        single_figures = summarise(single)
        figures_of = {config: summarise(runs, text=("transport",)) for config, runs in raw.items()}
        rows = []
        for schedule, m, transport in wanted:
            ran_as = same_as[(schedule, m, transport)]
            runs, figures = raw[(ran_as, m, transport)], figures_of[(ran_as, m, transport)]
            # the no-overlap baseline over the same transport, when that was run
            baseline = figures_of.get(("sequential", m, transport))
            row_bytes = (work.batch_size // m) * work.hidden * 4  # float32 activations at a cut
            rows.append({
                "schedule": schedule, "num_microbatches": m, "transport_requested": transport,
                "same_ops_as": ran_as if ran_as != schedule else None,
                "transport": figures["transport"], "samples_per_second": figures["samples_per_second"],
                "speedup_vs_sequential": ratio(figures["samples_per_second"], baseline["samples_per_second"])
                if baseline else None,
                "speedup_vs_sequential_parts": speedup_parts(figures, baseline) if baseline else None,
                "speedup_vs_single_process": ratio(figures["samples_per_second"], single_figures["samples_per_second"]),
                "bubble_fraction": figures["bubble_fraction"],
                "bubble_theory": gpipe_bubble(suite.num_stages, m) if schedule != "sequential" else None,
                "bubble_schedule_median_ops": figures.get("median_ops_bubble"),
                "bubble_schedule_measured_ops": figures["schedule_bubble"],
                "bubble_busiest_stage": figures["busiest_stage_bubble"],
                "stage_imbalance": figures["stage_imbalance"],
                "transfer_us": figures.get("transfer_us"),  # measured for the sequential schedule only
                "step_s": figures["step_s"], "critical_s": figures.get("critical_s"),
                "bytes_per_transfer": row_bytes,
                "time_fractions": {key: figures.get(f"{key}_fraction") for key in TIME_SHARES},
                "raw": runs,
            })
        transports = []
        for schedule in suite.other_transport_schedules:
            for m in suite.other_transport_microbatches:
                figures = {t: figures_of[(same_as[(schedule, m, t)], m, t)] for t in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)}
                main = figures[PIPELINE_TRANSPORT]["samples_per_second"]
                transports.append({
                    "schedule": schedule, "num_microbatches": m,
                    **{t: {"samples_per_second": f["samples_per_second"], "bubble_fraction": f["bubble_fraction"]}
                       for t, f in figures.items()},
                    **{f"{PIPELINE_TRANSPORT}_over_{t}": ratio(main, figures[t]["samples_per_second"])
                       for t in OTHER_TRANSPORTS},
                })
        return {"workload": asdict(work), "num_stages": suite.num_stages, "threads_per_stage": THREADS_PER_STAGE,
                "single_process": {**single_figures, "num_threads": THREADS_PER_STAGE, "raw": single},
                "configs": rows, "transports": transports}

    def ingest_case(self, consumption: dict[str, Any] | None) -> dict[str, Any]:
        self.log("[bench] ingest: Parquet -> batches in one Ray worker vs pyarrow alone")
        result = self.ingest()
        raypar_rps = stats([result["batched_rows"] / s for s in result["raypar_seconds"]])
        pyarrow_rps = stats([result["rows"] / s for s in result["pyarrow_seconds"]])
        return {
            "file": self.ddp_data, "rows": result["rows"], "file_bytes": os.path.getsize(self.ddp_data),
            "raypar_rows_per_second": raypar_rps,
            "pyarrow_rows_per_second": pyarrow_rps,
            "raypar_over_pyarrow": ratio(raypar_rps, pyarrow_rps),
            "ddp_samples_per_second": consumption,
            "ingest_over_training": ratio(raypar_rps, consumption) if consumption else None,
            "worker_rss_at_start_bytes": result["rss_at_start_bytes"],
            "worker_peak_rss_bytes": result["peak_rss_bytes"],
        }

    def _measure(self, into: list, label: str, rep: int, run: Callable[[], dict]) -> None:
        began, cpu = time.perf_counter(), cpu_times()
        result = run()
        into.append(result)
        result["steal_fraction"] = steal = steal_fraction(cpu, cpu_times())
        if steal is not None:
            self.steal.append({"run": f"{label}, run {rep + 1}", "steal_fraction": steal})
        sps = result.get("samples_per_second")
        sps = statistics.median(sps) if isinstance(sps, list) else sps
        self.log(f"[bench] {label}, run {rep + 1}: {sps:,.0f} samples/s, {time.perf_counter() - began:.1f} s")


CASES = ("data_parallel", "pipeline", "ingest")
PIPELINE_SCHEDULES = ("sequential", "gpipe", "1f1b")
PIPELINE_TRANSPORT = "p2p"  # raypar's default (auto); the sweep's transport
OTHER_TRANSPORTS = ("compiled", "actor_calls")  # compared with it at a few configurations
# The measured shares of the stages' time (wall x S); the rest is reported as `other`.
TIME_SHARES = ("compute", "optimizer", "receive_wait", "p2p_calls")


def same_ops_as(schedule: str, num_stages: int, num_microbatches: int) -> str:
    """The first of ``PIPELINE_SCHEDULES`` with exactly the same per-stage op lists (at M=1 all
    three are F0 B0 on every stage): such configurations are one run, reported under each name."""
    ops = SCHEDULES[schedule](num_stages, num_microbatches)
    return next(s for s in PIPELINE_SCHEDULES if SCHEDULES[s](num_stages, num_microbatches) == ops)


def worker_counts(max_workers: int, batch_size: int) -> list[int]:
    """1, 2, 4, ... up to ``max_workers`` (and ``max_workers`` itself), dividing the global batch."""
    counts, n = [], 1
    while n <= max_workers:
        counts.append(n)
        n *= 2
    if max_workers not in counts:
        counts.append(max_workers)
    return [n for n in counts if batch_size % n == 0]


def summarise(runs: list[dict[str, Any]], text: Sequence[str] = ()) -> dict[str, Any]:
    """Per-key statistics over repetitions; ``text`` keys keep their (single) value."""
    if not runs:
        return {}
    keys = {k for r in runs for k, v in r.items() if isinstance(v, (int, float, list)) and not isinstance(v, bool)}
    # A list holds one run's timed epochs: every epoch of every run is one repetition. None (or
    # a missing key): not measured in that run, e.g. CPU steal off Linux.
    values = {k: [x for r in runs for x in (r.get(k) if isinstance(r.get(k), list) else [r.get(k)]) if x is not None]
              for k in sorted(keys)}
    figures: dict[str, Any] = {k: stats(v) for k, v in values.items() if v}
    for key in text:
        values = sorted({str(r[key]) for r in runs})
        figures[key] = values[0] if len(values) == 1 else "/".join(values)
    return figures


# ---------------------------------------------------------------------------------------------
# Report


def targets(results: dict[str, Any]) -> list[dict]:
    found = []
    data_parallel = results.get("data_parallel")
    overhead = data_parallel["ddp_overhead"] if data_parallel else None
    # Judged where the host left both sides alone, if it did often enough: steal only slows.
    quiet_judged = overhead and overhead.get("quiet_samples_per_second_ratio")
    found.append(target(
        "DDP steady samples/s, raypar / torch" + (f", epochs with <= {QUIET_STEAL:.0%} steal" if quiet_judged else ""),
        quiet_judged or (overhead and overhead["samples_per_second_ratio"]),
        f">= {TARGET_DDP_RATIO}x", lambda v: v >= TARGET_DDP_RATIO, "x"))
    pipe, settings = results.get("pipeline"), results.get("settings", {})
    num_stages, m = settings.get("num_stages", "?"), settings.get("target_microbatches", "?")
    for schedule in ("gpipe", "1f1b"):
        row = _pipeline_row(pipe, schedule, m, PIPELINE_TRANSPORT) if pipe else None
        label = f"pipeline {schedule} S={num_stages} M={m}"
        found.append(target(f"{label} / sequential samples/s", row and row["speedup_vs_sequential"],
                            f">= {TARGET_PIPELINE_SPEEDUP}x", lambda v: v >= TARGET_PIPELINE_SPEEDUP, "x"))
        gap = None
        if row:
            gap = {k: row["bubble_fraction"][k] - row["bubble_theory"] for k in ("median", "min", "max")}
        found.append(target(f"{label} bubble - theory", gap, f"within ±{TARGET_BUBBLE_POINTS * 100:.0f} points",
                            lambda v: abs(v) <= TARGET_BUBBLE_POINTS, "points"))
    ingest = results.get("ingest")
    found.append(target("ingest rows/s / DDP samples/s", ingest and ingest["ingest_over_training"],
                        f">= {TARGET_INGEST_RATIO:g}x", lambda v: v >= TARGET_INGEST_RATIO, "x"))
    return found


def _pipeline_row(pipe: dict, schedule: str, m: int, transport: str) -> dict | None:
    for row in pipe["configs"]:
        if (row["schedule"], row["num_microbatches"], row["transport_requested"]) == (schedule, m, transport):
            return row
    return None


def render(results: dict[str, Any]) -> str:
    """The Markdown report: one table per case, then the targets."""
    machine = results["machine"]
    parts = [
        f"# raypar bench: suite `{results['suite']}`",
        "",
        f"{machine['cpu_count']} CPUs, torch {machine['torch']}, ray {machine['ray']}, python {machine['python']}, "
        f"{machine['platform']}; {results['seconds']:.0f} s; load average (1/5/15 min) "
        f"{machine.get('load_average_at_start')} at start, {machine.get('load_average_at_end')} at end. "
        f"{_steal_line(machine.get('steal_by_run'))}"
        "Figures: median (min–max) of the repetitions after a warm-up (throughput: every epoch after each "
        "run's first; start-up: the runs); ratios: ratio of medians (least–most favourable pairing).",
    ]
    data_parallel = results.get("data_parallel")
    dp_section: list[str] = []  # printed after the pipeline, in the order
    if data_parallel:
        work = data_parallel["workload"]
        overhead = data_parallel["ddp_overhead"]
        raypar, peer = overhead["raypar"], overhead["torch"]
        n = overhead["num_workers"]
        parts += [
            "", f"## 1. DDP overhead: raypar vs torch.multiprocessing.spawn + gloo, {n} workers",
            "",
            f"{_workload_line(work)}; 1 CPU and 1 torch thread per worker; "
            f"{len(overhead['raw']['raypar'])} raypar / {len(overhead['raw']['torch'])} torch repetitions.",
            "",
            markdown_table(
                ["measure", "raypar DDP (Ray Train)", "torch DDP (spawn, gloo)", "raypar / torch"],
                [
                    ["steady samples/s (epoch loops only)", fmt(raypar["samples_per_second"]),
                     fmt(peer["samples_per_second"]), fmt(overhead["samples_per_second_ratio"], ".3f")],
                    [f"the same, epochs with <= {QUIET_STEAL:.0%} CPU steal only", _quiet_cell(raypar),
                     _quiet_cell(peer), fmt(overhead.get("quiet_samples_per_second_ratio"), ".3f")],
                    ["fixed cost, s: wall - loop time (start-up, final checkpoint, teardown)",
                     fmt(raypar["startup_s"], ".1f"), fmt(peer["startup_s"], ".1f"),
                     fmt(overhead["startup_ratio"], ".1f")],
                    ["start-up, s: job start to first step", fmt(raypar.get("first_step_s"), ".2f"),
                     fmt(peer["first_step_s"], ".2f"), fmt(overhead.get("first_step_ratio"), ".1f")],
                    ["the rest, s: wall - start-up - loop (between epochs, final checkpoint, teardown)",
                     fmt(raypar.get("after_loop_s"), ".2f"), fmt(peer.get("after_loop_s"), ".2f"), "-"],
                    ["total wall, s", fmt(raypar["wall_s"], ".1f"), fmt(peer["wall_s"], ".1f"), "-"],
                    ["peak RSS per worker (the largest), MiB", fmt(raypar.get("peak_rss_bytes"), ".0f", 1 / MIB),
                     fmt(peer["peak_rss_bytes"], ".0f", 1 / MIB), fmt(overhead.get("peak_rss_ratio"), ".2f")],
                    ["CPU steal by the hypervisor, share of each run", fmt(raypar.get("steal_fraction"), ".1%"),
                     fmt(peer.get("steal_fraction"), ".1%"), "-"],
                ],
            ),
            "", "## 2. DDP scaling", "",
            f"{_workload_line(work)}; the cluster has {data_parallel['scaling']['cluster_cpus']} CPUs; "
            "efficiency = samples/s(N) / (N x samples/s(1)).",
            "",
            markdown_table(
                ["workers", "samples/s", "speed-up vs 1", "efficiency"],
                [[p["num_workers"], fmt(p["samples_per_second"]), fmt(p["speedup"], ".2f"), fmt(p["efficiency"], ".2f")]
                 for p in data_parallel["scaling"]["points"]],
            ),
        ]
        dp_vs_ddp = data_parallel["dp_vs_ddp"]
        dp_section += ["", f"## 4. DataParallel vs DDP on one node ({n} CPUs each)", ""]
        if "skipped" in dp_vs_ddp:
            dp_section += [f"Skipped: {dp_vs_ddp['skipped']}."]
        else:
            dp_section += [
                f"DataParallel: one worker holding {n} CPUs ({n} torch threads; `nn.DataParallel` only splits "
                f"over GPUs, so on CPU it is the plain model); DDP: {n} workers x 1 CPU.",
                "",
                markdown_table(
                    ["strategy", "samples/s", "DDP / DataParallel"],
                    [["DDP", fmt(dp_vs_ddp["ddp"]["samples_per_second"]), fmt(dp_vs_ddp["ddp_over_dp"], ".2f")],
                     ["DataParallel", fmt(dp_vs_ddp["dp"]["samples_per_second"]), "-"]],
                ),
            ]
    pipe = results.get("pipeline")
    if pipe:
        work, single = pipe["workload"], pipe["single_process"]
        parts += [
            "", f"## 3. Pipeline: {pipe['num_stages']} stage actors", "",
            f"{_workload_line(work)}; {pipe['threads_per_stage']} CPU and torch thread per stage. "
            f"Single process (plain torch loop, whole model, {single['num_threads']} thread): "
            f"{fmt(single['samples_per_second'])} samples/s. Bubble: share of the stages' time (wall x S) "
            "spent neither in forward/backward nor in the optimizer step (which every schedule runs once "
            "per batch, outside the fill and drain the theory counts); waiting, transfers and dispatch are "
            "bubble. Theory: GPipe (S-1)/(M+S-1), equal stages and free transfers. "
            "`(= sequential)`: the same op order on every stage, so one run reported under both names. "
            "`vs sequential` = `busy share` x `op speed` (medians, so nearly): the stages' busy share "
            "(1 - bubble) over the sequential runs' is what the schedule overlaps; samples per second "
            "of busy stage time over theirs is how fast the ops ran, which two stages computing at "
            "once, or a slow phase of the host, lowers whatever the schedule.",
            "",
            markdown_table(
                ["M", "schedule", "transport", "samples/s", "vs sequential", "busy share", "op speed",
                 "vs single process", "bubble", "bubble theory"],
                [[r["num_microbatches"], r["schedule"] + (f" (= {r['same_ops_as']})" if r["same_ops_as"] else ""),
                  r["transport"], fmt(r["samples_per_second"]),
                  fmt(r["speedup_vs_sequential"], ".2f"), *_speedup_parts_cells(r),
                  fmt(r["speedup_vs_single_process"], ".2f"),
                  fmt(r["bubble_fraction"], ".3f"),
                  f"{r['bubble_theory']:.3f}" if r["bubble_theory"] is not None else "-"]
                 for r in pipe["configs"]],
            ),
            "", f"### Where the stages' time goes (M={pipe['target_microbatches']})", "",
            "Shares of wall x S; `p2p calls`: gloo's send, receive-post and send-wait calls (p2p only); "
            "`other`: dispatch and Python between ops (and, for "
            "transports other than p2p, waiting, which only p2p measures apart). `schedule, measured "
            "ops`: the bubble of the schedule replayed with every op's and optimizer step's measured "
            "duration and instant transfers; `schedule, median ops`: the same with each stage's "
            "forwards, backwards and steps each at that stage's median. So theory to median ops is "
            "the cut (uneven stages, the optimizer steps); median to measured ops is the jitter of "
            "single ops (a slow op holds up the stage waiting for it); measured ops to the bubble is "
            "raypar's own cost (transfers, wake-ups, dispatch). `busiest stage`: "
            "the idle share of the stage with the most compute and optimizer time, which sets the pace; "
            "`imbalance`: that time over the least busy stage's. The gap between the bubble and the busiest stage's "
            "is the other stages idling because the cut is uneven.",
            "",
            markdown_table(
                ["schedule", "transport", "compute", "optimizer", "receive wait", "p2p calls", "other", "bubble",
                 "theory, equal stages", "schedule, median ops", "schedule, measured ops", "busiest stage",
                 "imbalance"],
                [[r["schedule"], r["transport"], *_time_shares(r),
                  fmt(r["bubble_fraction"], ".3f"),
                  f"{r['bubble_theory']:.3f}" if r["bubble_theory"] is not None else "-",
                  fmt(r.get("bubble_schedule_median_ops"), ".3f"), fmt(r["bubble_schedule_measured_ops"], ".3f"),
                  fmt(r.get("bubble_busiest_stage"), ".3f"),
                  fmt(r.get("stage_imbalance"), ".2f")]
                 for r in pipe["configs"]
                 if r["num_microbatches"] == pipe["target_microbatches"] and not r["same_ops_as"]],
            ),
            "", "### Transfer cost per micro-batch (sequential schedule: no compute overlaps)", "",
            "µs per transfer = (step time - critical path) / (2 (S-1) M), the critical path being every "
            "stage's forward and backward plus the first stage's optimizer step (each later stage steps "
            "while the gradient travels upstream); an upper bound, since the uncovered time also holds "
            "the driver's dispatch. "
            "Bytes = micro-batch rows x width x 4.",
            "",
            markdown_table(
                ["M", "micro-batch rows", "bytes per transfer", "transport", "step ms", "critical path ms",
                 "µs per transfer"],
                [[r["num_microbatches"], work["batch_size"] // r["num_microbatches"], f"{r['bytes_per_transfer']:,}",
                  r["transport"], fmt(r["step_s"], ".1f", 1e3), fmt(r["critical_s"], ".1f", 1e3),
                  fmt(r["transfer_us"], ",.0f")]
                 for r in pipe["configs"] if r["schedule"] == "sequential"],
            ),
        ]
        if pipe["transports"]:
            parts += [
                "", "### Transports", "",
                f"`{PIPELINE_TRANSPORT}` (the default): torch.distributed send/recv between the stage actors, one "
                "actor call per stage per few batches (`--batches-per-call`); `compiled`: a Ray Compiled Graph, one node per op; "
                "`actor_calls`: one Ray actor call per op, activations as object references.",
                "",
                markdown_table(
                    ["schedule", "M", *[f"{t} samples/s" for t in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
                     *[f"{PIPELINE_TRANSPORT} / {t}" for t in OTHER_TRANSPORTS],
                     *[f"{t} bubble" for t in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)]],
                    [[t["schedule"], t["num_microbatches"],
                      *[fmt(t[k]["samples_per_second"]) for k in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
                      *[fmt(t[f"{PIPELINE_TRANSPORT}_over_{k}"], ".2f") for k in OTHER_TRANSPORTS],
                      *[fmt(t[k]["bubble_fraction"], ".3f") for k in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)]]
                     for t in pipe["transports"]],
                ),
            ]
    parts += dp_section
    ingest = results.get("ingest")
    if ingest:
        parts += [
            "", "## 5. Data ingest: Parquet to training batches in one Ray worker", "",
            f"{ingest['rows']:,} rows, {ingest['file_bytes'] / MIB:.2f} MiB (the DDP data). raypar: `read_dataset` "
            "(read + validate) plus one epoch of the loop's batch indexing; one worker producing every global "
            "batch, against the whole DDP job's consumption (conservative: a DDP worker indexes 1/N of each). "
            f"Worker RSS: {ingest['worker_rss_at_start_bytes'] / MIB:.0f} MiB at start, "
            f"{ingest['worker_peak_rss_bytes'] / MIB:.0f} MiB peak.",
            "",
            markdown_table(
                ["path", "rows/s", "ratio"],
                [["pyarrow.parquet.read_table alone", fmt(ingest["pyarrow_rows_per_second"]), "-"],
                 ["raypar read_dataset + batch indexing", fmt(ingest["raypar_rows_per_second"]),
                  fmt(ingest["raypar_over_pyarrow"], ".2f") + " of pyarrow"],
                 ["DDP training consumption (samples/s)", fmt(ingest["ddp_samples_per_second"]),
                  fmt(ingest["ingest_over_training"], ".1f") + "x headroom"
                  if ingest["ingest_over_training"] else "-"]],
            ),
        ]
    parts += [
        "", "## Targets (this machine: CPU, gloo; reported, not asserted)", "",
        markdown_table(
            ["target", "goal", "measured", "target"],
            [[t["name"], t["goal"],
              fmt(t["measured"], "+.3f" if t.get("unit") == "points" else ".2f") if t["measured"] else "-",
              t["status"]] for t in results["targets"]],
        ),
        "",
        "A target is `met` or `missed` when the median and both ends of its range agree; `within noise` "
        "when the range (least–most favourable pairing) reaches across the goal: more repetitions or a "
        "quieter machine decide it.",
        "",
        f"Plots: {', '.join(results['plots'])}." if isinstance(results["plots"], list) else f"{results['plots']}.",
    ]
    return "\n".join(parts) + "\n"


def _quiet_cell(figures: dict[str, Any]) -> str:
    quiet_figure = figures.get("samples_per_second_quiet")
    return f"{fmt(quiet_figure)}, {len(quiet_figure['values'])} epochs" if quiet_figure else "no quiet epoch"


def _steal_line(runs: list[dict[str, Any]] | None) -> str:
    if not runs:
        return ""
    worst = max(runs, key=lambda r: r["steal_fraction"])
    median = statistics.median(r["steal_fraction"] for r in runs)
    return (f"CPU time taken by the hypervisor (steal) during the measured runs: median {median:.1%}, "
            f"most {worst['steal_fraction']:.1%} ({worst['run']}). ")


def _speedup_parts_cells(row: dict) -> list[str]:
    """The split computed when the row was measured; ``-`` without a baseline, or in a report
    that predates it."""
    parts = row.get("speedup_vs_sequential_parts")
    return [fmt(parts[k], ".2f") for k in ("busy_share", "op_speed")] if parts else ["-", "-"]


def _time_shares(row: dict) -> list[str]:
    """The measured shares, ``-`` for one a report predates, and the rest as ``other``."""
    known = [row["time_fractions"].get(k) for k in TIME_SHARES]
    medians = [share["median"] for share in known if share]
    return [*(f"{share['median']:.3f}" if share else "-" for share in known), f"{1.0 - sum(medians):.3f}"]


def _workload_line(work: dict[str, Any]) -> str:
    return (f"`{work['model']}` hidden {work['hidden']} depth {work['depth']}, {work['in_features']} -> "
            f"{work['out_features']}, {work['rows']:,} rows, global batch {work['batch_size']}, "
            f"{work['epochs']} epoch{'s' if work['epochs'] != 1 else ''} of {work['rows'] // work['batch_size']} steps")


def write_plots(results: dict[str, Any], out: str) -> list[str] | str:
    """PNG plots when matplotlib is installed; otherwise why they were skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plots skipped: matplotlib not installed"
    written = []

    def save(figure, name: str) -> None:
        path = os.path.join(out, name)
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(name)

    def errors(figures: list[dict]) -> list[list[float]]:
        return [[f["median"] - f["min"] for f in figures], [f["max"] - f["median"] for f in figures]]

    data_parallel = results.get("data_parallel")
    if data_parallel:
        points = data_parallel["scaling"]["points"]
        counts = [p["num_workers"] for p in points]
        figures = [p["samples_per_second"] for p in points]
        figure, axis = plt.subplots(figsize=(5, 4))
        axis.errorbar(counts, [f["median"] for f in figures], yerr=errors(figures), marker="o", capsize=3,
                      label="raypar DDP")
        axis.set_xticks(counts)
        if counts and counts[0] == 1:
            axis.plot(counts, [figures[0]["median"] * n for n in counts], "--", color="grey", label="linear")
        axis.set(xlabel="workers", ylabel="samples/s", title="DDP scaling")
        axis.legend()
        save(figure, "scaling.png")

        overhead = data_parallel["ddp_overhead"]
        figure, axes = plt.subplots(1, 2, figsize=(8, 4))
        for axis, key, label in ((axes[0], "samples_per_second", "steady samples/s"),
                                 (axes[1], "startup_s", "wall - loop time, s")):
            pair = [overhead["raypar"][key], overhead["torch"][key]]
            axis.bar(["raypar", "torch"], [f["median"] for f in pair], yerr=errors(pair), capsize=4)
            axis.set(title=label)
        save(figure, "ddp_overhead.png")

    pipe = results.get("pipeline")
    if pipe:
        swept = [r for r in pipe["configs"] if r["transport_requested"] == PIPELINE_TRANSPORT]
        figure, axes = plt.subplots(1, 2, figsize=(10, 4))
        for schedule in ("gpipe", "1f1b", "sequential"):
            rows = [r for r in swept if r["schedule"] == schedule]
            ms = [r["num_microbatches"] for r in rows]
            figures = [r["samples_per_second"] for r in rows]
            axes[0].errorbar(ms, [f["median"] for f in figures], yerr=errors(figures), marker="o", capsize=3,
                             label=schedule)
            if schedule != "sequential":
                bubbles = [r["bubble_fraction"] for r in rows]
                axes[1].errorbar(ms, [f["median"] for f in bubbles], yerr=errors(bubbles), marker="o", capsize=3,
                                 label=f"{schedule} measured")
        axes[0].axhline(pipe["single_process"]["samples_per_second"]["median"], ls="--", color="grey",
                        label="single process")
        ms = sorted({r["num_microbatches"] for r in swept})
        axes[1].plot(ms, [gpipe_bubble(pipe["num_stages"], m) for m in ms], "k--", label="GPipe theory")
        for axis in axes:
            axis.set_xscale("log", base=2)
            axis.set_xticks(ms, [str(m) for m in ms])
            axis.set_xlabel("micro-batches M")
            axis.legend()
        axes[0].set(ylabel="samples/s", title="pipeline throughput")
        axes[1].set(ylabel="bubble fraction", title="pipeline bubble")
        save(figure, "pipeline.png")

        sequential = [r for r in pipe["configs"] if r["schedule"] == "sequential"]
        figure, axis = plt.subplots(figsize=(5, 4))
        for transport in sorted({r["transport"] for r in sequential}):
            rows = [r for r in sequential if r["transport"] == transport]
            figures = [r["transfer_us"] for r in rows]
            axis.errorbar([r["bytes_per_transfer"] for r in rows], [f["median"] for f in figures],
                          yerr=errors(figures), marker="o", capsize=3, label=transport)
        axis.set_xscale("log", base=2)
        sizes = sorted({r["bytes_per_transfer"] for r in sequential})
        axis.set_xticks(sizes, [f"{b // 1024:,} KiB" if b >= 1024 else f"{b} B" for b in sizes])
        axis.set(xlabel="bytes per transfer", ylabel="µs per transfer (upper bound)", title="transfer cost")
        axis.legend()
        save(figure, "transfer.png")
    return written


def machine_info() -> dict[str, Any]:
    import ray

    return {
        "cpu_count": os.cpu_count(),
        "cluster_cpus": ray.cluster_resources().get("CPU"),
        "cluster_nodes": len([n for n in ray.nodes() if n.get("Alive")]),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads_default": torch.get_num_threads(),
        "load_average_at_start": _load_average(),
    }


def _load_average() -> list[float] | None:
    """1, 5 and 15-minute load: other work on the machine makes every figure noisier."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def run_suite(suite: Suite, out: str, storage_path: str, address: str | None,
              cases: Sequence[str] = CASES) -> dict[str, Any]:
    """Run ``suite`` and write ``bench.json``, ``bench.md`` and plots into ``out``."""
    from ray_jobs.session import connect

    began = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    connect(address)
    bench = Bench(suite, out, storage_path)
    results: dict[str, Any] = {"suite": suite.name, "settings": asdict(suite), "machine": machine_info(),
                               "complete": False}
    if "data_parallel" in cases:
        results["data_parallel"] = bench.data_parallel_cases()
        _write_json(results, out)  # a later case failing keeps what was measured
    if "pipeline" in cases:
        results["pipeline"] = {**bench.pipeline_case(), "target_microbatches": suite.target_microbatches}
        _write_json(results, out)
    if "ingest" in cases:
        data_parallel = results.get("data_parallel")
        consumption = data_parallel["ddp_overhead"]["raypar"]["samples_per_second"] if data_parallel else None
        results["ingest"] = bench.ingest_case(consumption)
    results["targets"] = targets(results)
    results["seconds"] = time.perf_counter() - began
    results["machine"]["load_average_at_end"] = _load_average()
    results["machine"]["steal_by_run"] = bench.steal
    results["complete"] = True
    _write_report(results, out)
    return results


def rerender(out: str) -> dict[str, Any]:
    """Write ``bench.md`` and the plots in ``out`` anew from its ``bench.json``, measuring
    nothing: for a run made without matplotlib, or after a change to the report."""
    path = os.path.join(out, "bench.json")
    try:
        with open(path) as handle:
            results = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--render {out}: cannot read {path}: {error}") from None
    if not results.get("complete"):
        raise ValueError(f"--render {out}: {path} is from a bench run that did not finish; run the bench again")
    _write_report(results, out)
    return results


def _write_report(results: dict[str, Any], out: str) -> None:
    results["plots"] = write_plots(results, out)
    _write_json(results, out)
    with open(os.path.join(out, "bench.md"), "w") as handle:
        handle.write(render(results))


def _write_json(results: dict[str, Any], out: str) -> None:
    path = os.path.join(out, "bench.json")
    with open(path + ".partial", "w") as handle:
        json.dump(results, handle, indent=2, default=str)
    os.replace(path + ".partial", path)



def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m ray_jobs.bench", description=__doc__)
    parser.add_argument("--suite", default="quick",
                        help="; ".join(f"{s.name}: {s.description}" for s in SUITES.values()) + " (default: quick)")
    parser.add_argument("--out", default="runs/bench", help="output folder (default: runs/bench)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated subset of {', '.join(CASES)} (default: all)")
    parser.add_argument("--storage-path", default=None,
                        help="where the benchmarked runs write checkpoints; shared storage on a multi-node "
                             "cluster (default: a temporary local folder, deleted at the end)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to join (default: RAY_ADDRESS, else a new local one)")
    parser.add_argument("--render", metavar="DIR", default=None,
                        help="measure nothing: write DIR/bench.md and the plots anew from DIR/bench.json "
                             "(after installing matplotlib, or after a change to the report)")
    args = parser.parse_args(argv)
    if args.render is not None:
        return _rerender_main(args.render)
    if args.suite not in SUITES:
        parser.error(f"--suite {args.suite!r} is unknown; valid: {', '.join(SUITES)}")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        parser.error(f"--cases {args.cases!r}: valid cases are {', '.join(CASES)}")
    scratch = None if args.storage_path else tempfile.mkdtemp(prefix="raypar-bench-")
    try:
        results = run_suite(SUITES[args.suite], args.out, args.storage_path or scratch, args.address, cases)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted; {os.path.join(args.out, 'bench.json')} holds the cases finished so far, if any",
              file=sys.stderr)
        return 130
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    print(render(results))
    print(f"wrote {os.path.join(args.out, 'bench.json')} and bench.md")
    return 0


def _rerender_main(out: str) -> int:
    try:
        results = rerender(out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    plots = results["plots"]  # the PNGs written, or why none were
    said = f"plots: {', '.join(plots)}" if isinstance(plots, list) else plots
    print(f"wrote {os.path.join(out, 'bench.md')}; {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
