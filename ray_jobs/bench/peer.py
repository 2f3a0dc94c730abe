"""The plain-PyTorch peer the bench compares raypar with: ``torch.multiprocessing.spawn`` + gloo (or
one process), no Ray; on GPUs (``device="cuda"``), one process per GPU over nccl. Any task raypar
trains: a language model's rows are int64 tokens, its loss the mean token cross-entropy
(``loss_function("lm")``), and the built-in gpt is built as raypar builds it (``make_model``: its
``block_size`` the data's context length unless an option says otherwise)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

# No Ray here, nor in anything imported here: the peer's spawned processes import this module,
# and importing Ray there would inflate the peer's start-up cost.
from ray_jobs.core.batches import global_batches, shard
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.model_init import make_model
from ray_jobs.core.step import build_optimizer, grad_scaler, loss_function, train_step
from ray_jobs.data.order import epoch_order
from ray_jobs.data.parquet import Dataset
from ray_jobs.observability.process_stats import cpu_times, peak_rss_bytes, steal_fraction

PEER_TIMEOUT_S = 600.0


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
    niceness: int = 0
    """World rank 0's scheduling niceness as it trained."""


def torch_ddp(
    cfg: TrainConfig,
    dataset: Dataset,
    initial_state: dict[str, torch.Tensor],
    world_size: int,
    num_threads: int = 1,
    timeout_s: float = PEER_TIMEOUT_S,
    device: str = "cpu",
    niceness: int = 0,
) -> PeerResult:
    """Train with plain torch.distributed DDP: ``world_size`` processes from
    ``torch.multiprocessing.spawn``, gloo on 127.0.0.1 (``device`` "cuda": rank r on GPU r, nccl);
    one process and no DDP when 1. ``niceness``: each process's scheduling niceness (at least
    this process's), so that it can run at the priority Ray gives raypar's workers."""
    with tempfile.TemporaryDirectory(prefix="raypar-bench-peer-") as directory:
        began = time.time()
        context = mp.spawn(
            _peer_worker,
            args=(world_size, asdict(cfg), dataset, initial_state, num_threads, directory, timeout_s, device, niceness),
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
        niceness=rank0["niceness"],
    )


def _peer_worker(
    world_rank: int,
    world_size: int,
    train: dict[str, Any],
    dataset: Dataset,
    initial_state: dict[str, torch.Tensor],
    num_threads: int,
    directory: str,
    timeout_s: float,
    device: str = "cpu",
    niceness: int = 0,
) -> None:
    """The DDP tutorial's worker over raypar's training contract: what raypar's loop does, minus Ray."""
    cfg = TrainConfig(**train)
    os.nice(max(0, niceness - os.nice(0)))  # only ever raised: lowering it needs privileges
    torch.set_num_threads(num_threads)
    on = torch.device(f"cuda:{world_rank}" if device == "cuda" else "cpu")
    if on.type == "cuda":
        torch.cuda.set_device(on)  # nccl's collectives (the barrier too) run on the current device
    if world_size > 1:
        # The tutorial's MASTER_PORT would need a port picked free in advance, which another
        # process can take before rank 0 binds it; a file store in the run's folder cannot race.
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            init_method=f"file://{os.path.join(directory, 'store')}",
            rank=world_rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    model = make_model(cfg, dataset)  # the data's widths, and for the gpt its context length
    model.load_state_dict(initial_state)
    model.to(on)
    optimizer = build_optimizer(model.parameters(), cfg)
    scaler = grad_scaler(cfg.precision, on)
    wrapped = (
        DistributedDataParallel(model, device_ids=[on.index] if on.type == "cuda" else None)
        if world_size > 1
        else model
    )
    features, targets = (tensor.to(on) for tensor in dataset.tensors())  # on the GPU once, as raypar's loop
    loss_fn = loss_function(dataset.task)

    first_step_at, losses, samples, epoch_seconds, epoch_steal = None, [], 0, [], []
    for epoch in range(cfg.epochs):
        began, cpu = time.perf_counter(), cpu_times()
        batches = global_batches(epoch_order(dataset.num_rows, cfg.seed, epoch, cfg.shuffle), cfg.batch_size)
        step_losses = torch.zeros(len(batches), device=on)
        for step, batch in enumerate(batches):
            if first_step_at is None:
                first_step_at = time.time()
            rows = shard(batch, world_size, world_rank).to(on)
            step_losses[step] = train_step(
                wrapped, optimizer, loss_fn, features[rows], targets[rows], precision=cfg.precision, scaler=scaler
            ).loss
        # raypar's loop also all-reduces the step losses once per epoch, inside its timing.
        if world_size > 1:
            dist.all_reduce(step_losses)
            step_losses = step_losses / world_size
        losses.append(sum(step_losses.tolist()) / len(batches))
        epoch_seconds.append(time.perf_counter() - began)
        epoch_steal.append(steal_fraction(cpu, cpu_times()))
        samples += len(batches) * cfg.batch_size
    result = {
        "first_step_at": first_step_at,
        "losses": losses,
        "samples": samples,
        "epoch_seconds": epoch_seconds,
        "epoch_steal": epoch_steal,
        "peak_rss_bytes": peak_rss_bytes(),
        "niceness": os.nice(0),
    }
    if world_rank == 0:
        result["state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    torch.save(result, os.path.join(directory, f"rank{world_rank}.pt"))
    if world_size > 1:
        # Leave together: a rank tearing gloo down while its peer is still saving can abort it.
        dist.barrier()
        del wrapped  # DDP's reducer holds the process group, which would outlive destroy_process_group
        dist.destroy_process_group()
    # The result is on disk. Skip the interpreter's teardown: under load it has aborted a rank
    # ("terminate called without an active exception", SIGABRT) while freeing gloo's threads,
    # which failed a run whose work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
