"""FSDP2's levers on CPU/gloo, outside Ray: seconds per training step of the built-in gpt for DDP
and for FSDP with each lever added in turn, 2 gloo processes of one thread each, the same model,
tokens and optimizer. It attributes the fsdp ÷ ddp ratio the bench's sharding case reports to its
parts (docs/performance.md).

    python scripts/fsdp_levers.py --n-embd 256 --n-layer 6 --block-size 128 --rows-per-rank 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from models import build_model
from ray_jobs.core.shard_plan import shard_units

VARIANTS = (
    "ddp",
    "ddp+foreach",  # raypar's DDP
    "fsdp",
    "fsdp+last-kept",
    "fsdp+last-kept+prefetch",
    "fsdp+last-kept+prefetch+foreach",  # raypar's FSDP
    "fsdp+last-kept+prefetch+fused",  # not bit-identical to torch's default AdamW
    "fsdp+all-kept+prefetch+foreach",  # --no-reshard-after-forward
)


def build(variant: str, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    options = {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd, "block_size": args.block_size}
    model = build_model("gpt", 257, 257, **options)
    if variant.startswith("ddp"):
        model = DistributedDataParallel(model)
    else:
        units = [model.get_submodule(name) for name in shard_units(model)]
        for index, unit in enumerate(units):
            last = index == len(units) - 1
            fully_shard(unit, reshard_after_forward=not ((last and "last-kept" in variant) or "all-kept" in variant))
        fully_shard(model)
        if "prefetch" in variant:
            model._set_unshard_async_op(True)
            for before, after in zip(units, units[1:]):
                before.set_modules_to_forward_prefetch([after])
                after.set_modules_to_backward_prefetch([before])
    fast = {"foreach": True} if "foreach" in variant else {"fused": True} if "fused" in variant else {}
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **fast)


def worker(rank: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tokens = torch.randint(
        257, (args.rows_per_rank, args.block_size + 1), generator=torch.Generator().manual_seed(rank)
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    for _ in range(args.repetitions):
        for variant in VARIANTS:  # interleaved: the machine's drift falls on every variant
            model, optimizer = build(variant, args)
            seconds, optimizer_seconds = [], []
            for step in range(args.steps + 1):
                dist.barrier()
                began = time.perf_counter()
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                loss.backward()
                stepped = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if step:  # the first step is the warm-up
                    seconds.append(time.perf_counter() - began)
                    optimizer_seconds.append(time.perf_counter() - stepped)
            if rank == 0:
                results.append((variant, statistics.median(seconds), statistics.median(optimizer_seconds)))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for flag, default in (("n-embd", 256), ("n-layer", 6), ("n-head", 4), ("block-size", 128), ("rows-per-rank", 8)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(worker, (args, results), nprocs=2)
        by_variant: dict[str, list[tuple[float, float]]] = {}
        for variant, seconds, optimizer_seconds in results:
            by_variant.setdefault(variant, []).append((seconds, optimizer_seconds))
    ddp = statistics.median(step for step, _ in by_variant["ddp+foreach"])
    for variant in VARIANTS:
        step = statistics.median(step for step, _ in by_variant[variant])
        optimizer = statistics.median(o for _, o in by_variant[variant])
        print(
            f"{variant:34s} {step * 1e3:7.1f} ms/step (optimizer {optimizer * 1e3:5.1f})  "
            f"{ddp / step:5.2f}x ddp+foreach's steps/s  {[round(s * 1e3, 1) for s, _ in by_variant[variant]]}"
        )


if __name__ == "__main__":
    main()
