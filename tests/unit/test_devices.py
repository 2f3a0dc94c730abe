"""Shared GPUs and batches to the device, decided without a GPU or Ray."""

from __future__ import annotations

import pytest
import torch

from ray_jobs.data.device_copy import prefetched, to_device
from ray_jobs.driver.resources import gpu_sharing
from ray_jobs.pipeline.scaling import PipelineScaling
from ray_jobs.pipeline.transports import resolve_transport


@pytest.mark.parametrize(
    ("num_workers", "gpus_per_worker", "gpus_per_node", "shared"),
    [
        # the run: two workers at 0.5 on one GPU (nccl failed after 57 s)
        (2, 0.5, 1, "--num-workers 2 with --gpus-per-worker 0.5 on nodes of 1 GPU: they share GPUs"),
        # fractions Ray packs onto one device even where there are GPUs enough for one each
        (
            2,
            0.5,
            8,
            "--num-workers 2 with --gpus-per-worker 0.5: Ray packs fractions onto one GPU, so they may share one",
        ),
        (4, 0.25, 2, "--num-workers 4 with --gpus-per-worker 0.25 on nodes of 2 GPU: they share GPUs"),
        (
            3,
            0.5,
            None,
            "--num-workers 3 with --gpus-per-worker 0.5: Ray packs fractions onto one GPU, so they may share one",
        ),
        # more workers than a node's GPUs, but two fractions of 0.6 never fit on one device
        (4, 0.6, 2, None),
        # whole GPUs: each worker its own device; more workers than GPUs is the resource preflight's refusal
        (2, 1.0, 1, None),
        (8, 1.0, 8, None),
        (2, 2.0, 8, None),
        # one worker has no peer to share with, whatever its fraction
        (1, 0.25, 1, None),
        # CPU workers
        (4, None, None, None),
        (4, 0.0, 0, None),
    ],
)
def test_which_runs_share_a_gpu(num_workers, gpus_per_worker, gpus_per_node, shared):
    assert gpu_sharing(num_workers, gpus_per_worker, gpus_per_node) == shared


def test_stages_sharing_a_gpu_go_over_p2p_and_refuse_nccl():
    shared = PipelineScaling(num_stages=2, use_gpu=True, gpus_per_stage=0.5)
    assert shared.bundles == [{"CPU": 1.0, "GPU": 0.5}] * 2
    assert resolve_transport(shared, ["a", "a"]) == "p2p"  # auto: gloo carries stages on one GPU
    assert resolve_transport(PipelineScaling(num_stages=2, use_gpu=True), ["a", "a"]) == "compiled"
    assert resolve_transport(PipelineScaling(num_stages=2, use_gpu=True, gpus_per_stage=0.6), ["a", "a"]) == "compiled"
    from ray_jobs.core.config import TrainConfig

    with pytest.raises(
        ValueError,
        match=r"--transport compiled cannot connect stages that share a GPU "
        r"\(--num-stages 2 with --gpus-per-stage 0.5: .*use --transport p2p",
    ):
        PipelineScaling(num_stages=2, use_gpu=True, gpus_per_stage=0.5, transport="compiled").check(
            TrainConfig(model="seed-split")
        )
    PipelineScaling(num_stages=2, use_gpu=True, gpus_per_stage=0.5, transport="actor_calls").check(
        TrainConfig(model="seed-split")
    )  # the object store carries any tensor


def test_gpus_per_stage_needs_gpus():
    with pytest.raises(ValueError, match="--gpus-per-stage needs --use-gpu"):
        PipelineScaling(gpus_per_stage=0.5)
    with pytest.raises(ValueError, match="--gpus-per-stage must be positive"):
        PipelineScaling(use_gpu=True, gpus_per_stage=0)


def test_batches_to_the_cpu_are_a_no_op():
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3)]
    got = list(prefetched(iter(batches), torch.device("cpu")))
    assert all(a is x and b is y for (a, b), (x, y) in zip(got, batches))  # the same tensors, no copy
    tensor = torch.randn(2)
    assert to_device(tensor, torch.device("cpu")) is tensor


def test_no_batch_is_read_ahead_on_the_cpu():
    read = []

    def batches():
        for index in range(3):
            read.append(index)
            yield torch.zeros(1), torch.zeros(1)

    for index, _ in enumerate(prefetched(batches(), torch.device("cpu"))):
        assert read == list(range(index + 1))


def test_rows_stay_on_the_host_when_they_do_not_fit_the_gpu(monkeypatch):
    from ray_jobs.data.device_copy import data_device

    gpu = torch.device("cuda", 0)
    assert data_device(10**9, torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda device: (4 * 2**30, 80 * 2**30))  # 4 GiB free
    assert data_device(2**30, gpu) == gpu  # copied once
    assert data_device(3 * 2**30, gpu) == torch.device("cpu")  # over half the free memory: batch by batch


@pytest.mark.parametrize(("gpus_per_worker", "backend"), [(0.5, "gloo"), (1.0, None)])
def test_ddp_workers_that_may_share_a_gpu_all_reduce_over_gloo_and_say_so(
    gpus_per_worker, backend, monkeypatch, capsys
):
    from ray_jobs.core.config import WorkerScaling
    from ray_jobs.data_parallel import trainer as train_workers

    monkeypatch.setattr("ray.nodes", lambda: [{"Alive": True, "Resources": {"CPU": 16.0, "GPU": 1.0}}])
    scaling = WorkerScaling(num_workers=2, use_gpu=True, gpus_per_worker=gpus_per_worker)
    assert train_workers._process_group(scaling).backend == backend  # None: Ray Train's nccl on GPUs
    said = capsys.readouterr().out.strip().splitlines()
    assert said == (
        []
        if backend is None
        else [
            "[raypar] --num-workers 2 with --gpus-per-worker 0.5 on nodes of 1 GPU: they share GPUs; nccl cannot run "
            "two ranks on one GPU, so the workers all-reduce over gloo (through host memory, slower; "
            "--gpus-per-worker 1 gives each its own GPU and nccl)"
        ]
    )
