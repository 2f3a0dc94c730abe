"""--count-comm-bytes: the buffers handed to torch.distributed, counted inside steps only."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ray_jobs.observability.comm_bytes import KINDS, CommBytes


@pytest.fixture
def one_process_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_calls_inside_a_step_are_counted_by_kind_and_ddp_buckets_through_its_hook(one_process_group):
    off = CommBytes(False)
    assert off.per_step() is None
    counter = CommBytes(True)
    dist.all_reduce(torch.ones(100))  # outside a step: not a step's traffic
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 4))  # 36 fp32 parameters
    counter.hook_ddp(model)
    for _ in range(2):
        with counter.step():
            model(torch.ones(3, 8)).sum().backward()
            dist.all_reduce(tensor=torch.ones(10, dtype=torch.float64))  # by keyword, 8 bytes each
            out = torch.empty(6)
            dist.all_gather_single(out, torch.ones(6))
    per_step = counter.per_step()
    assert set(per_step) == set(KINDS)
    assert per_step["all_reduce"] == 36 * 4 + 10 * 8 and per_step["all_gather"] == 6 * 4
    assert per_step["send"] == per_step["reduce_scatter"] == 0
    assert torch.allclose(model.module.bias.grad, torch.full((4,), 6.0))  # two steps of 3 rows, averaged over 1
