"""Configuration validation and the flags generated from it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_jobs.core.batches import global_batches, shard, shard_weight
from ray_jobs.core.checkpoint import load_named_optimizer_state, named_optimizer_state
from ray_jobs.core.config import ArgumentParser, TrainConfig, WorkerScaling, add_flags, from_args, require_divisible
from ray_jobs.data.order import epoch_order
from ray_jobs.data_parallel.dp import DataParallelScaling


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "vit"}, "--model 'vit' is unknown"),
        ({"optimizer": "lion"}, "--optimizer 'lion' is unknown; valid: sgd, adamw"),
        ({"epochs": 0}, "--epochs must be at least 1, got 0"),
        ({"batch_size": -4}, "--batch-size must be at least 1, got -4"),
        ({"lr": 0}, "--lr must be positive"),
        ({"momentum": -0.1}, "--momentum must be zero or more"),
        ({"max_failures": -1}, "--max-failures must be zero or more"),
        ({"hidden": 0}, "--hidden must be at least 1"),
        ({"optimizer": "adamw", "momentum": 0.9}, "--momentum applies to --optimizer sgd only"),
        ({"checkpoint_every": 0}, "--checkpoint-every must be at least 1"),
    ],
)
def test_train_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": 0}, "--num-workers must be at least 1, got 0"),
        ({"num_workers": -2}, "--num-workers must be at least 1"),
        ({"cpus_per_worker": 0}, "--cpus-per-worker must be positive"),
        ({"gpus_per_worker": 0.5}, "--gpus-per-worker needs --use-gpu"),
        ({"placement_strategy": "RANDOM"}, "--placement-strategy 'RANDOM' is unknown"),
    ],
)
def test_scaling_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkerScaling(**kwargs)


def test_gpu_resources_per_worker():
    assert WorkerScaling(use_gpu=True).resources_per_worker == {"CPU": 1.0, "GPU": 1.0}
    assert WorkerScaling(use_gpu=True, gpus_per_worker=0.25).resources_per_worker == {"CPU": 1.0, "GPU": 0.25}
    assert DataParallelScaling(gpus=4).workers().resources_per_worker == {"CPU": 1.0, "GPU": 4.0}
    assert DataParallelScaling().workers().resources_per_worker == {"CPU": 1.0}


def test_batch_must_divide():
    require_divisible(32, 4, "--num-workers")
    with pytest.raises(ValueError, match="--batch-size 30 is not divisible by --num-workers 4"):
        require_divisible(30, 4, "--num-workers")


def test_an_uneven_batch_splits_into_nearly_equal_contiguous_slices():
    batch = torch.arange(32)
    slices = [shard(batch, 3, rank) for rank in range(3)]
    assert [len(part) for part in slices] == [11, 11, 10]
    assert torch.equal(torch.cat(slices), batch)
    assert [shard_weight(32, 4, rank) for rank in range(4)] == [1.0] * 4  # even: exactly unscaled


def test_weighted_shard_losses_average_to_the_global_batch_gradient():
    """What DDP does with 3 workers and a batch of 32 (slices 11, 11, 10): all-reduce averages the
    3 gradients, so each slice's mean loss is weighted by its share of the batch times 3."""
    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(4, 2), torch.randn(32, 4), torch.randn(32, 2)
    loss_fn = torch.nn.MSELoss()

    def gradient(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    reference = gradient(loss_fn(model(x), y))
    rows = torch.arange(32)
    per_worker = [
        gradient(loss_fn(model(x[shard(rows, 3, r)]), y[shard(rows, 3, r)]) * shard_weight(32, 3, r)) for r in range(3)
    ]
    unweighted = [gradient(loss_fn(model(x[shard(rows, 3, r)]), y[shard(rows, 3, r)])) for r in range(3)]
    # float32 sums over other groupings of the same 32 rows: rounding only
    torch.testing.assert_close(sum(per_worker) / 3, reference, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(sum(unweighted) / 3, reference, rtol=1e-5, atol=1e-6)  # the weighting matters


def test_flags_round_trip():
    parser = ArgumentParser()
    add_flags(parser, TrainConfig, "training")
    add_flags(parser, WorkerScaling, "placement")
    args = parser.parse_args(["--no-shuffle", "--epochs", "5", "--use-gpu", "--gpus-per-worker", "0.5", "--depth", "3"])
    cfg, scaling = from_args(TrainConfig, args), from_args(WorkerScaling, args)
    assert (cfg.shuffle, cfg.epochs, cfg.depth, cfg.hidden) == (False, 5, 3, None)
    assert (scaling.use_gpu, scaling.gpus_per_worker) == (True, 0.5)
    assert from_args(TrainConfig, parser.parse_args([])) == TrainConfig()


def test_train_config_keeps_its_flag_groups_in_help_order():
    # TrainConfig is built from one dataclass per group: their fields must still come group by group,
    # first to last, as --help, repr and summary.json have always listed them.
    groups = [f.metadata["group"] for f in dataclasses.fields(TrainConfig)]
    assert list(dict.fromkeys(groups)) == ["data", "model", "training", "checkpoints", "ingest", "placement"]
    assert groups == sorted(groups, key=groups.index)  # no group split in two
    assert [f.name for f in dataclasses.fields(TrainConfig)][:3] == ["data", "feature_column", "target_column"]


def test_epoch_order_is_the_distributed_sampler_order():
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(10), num_replicas=1, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(2)
    assert epoch_order(10, seed=3, epoch=2, shuffle=True).tolist() == list(sampler)
    assert epoch_order(4, seed=3, epoch=0, shuffle=False).tolist() == [0, 1, 2, 3]


def test_global_batches_drop_the_last_partial_batch_and_shard_evenly():
    batches = global_batches(torch.arange(10), 4)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [shard(batches[1], 2, i).tolist() for i in range(2)] == [[4, 5], [6, 7]]


def test_optimizer_state_round_trips_by_parameter_name():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    named = named_optimizer_state(optimizer, dict(model.named_parameters()))
    assert set(named["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    # A "stage" that holds only the second layer restores just its own parameters' state.
    stage = torch.nn.Sequential()
    stage.add_module("1", model[1])
    stage_optimizer = torch.optim.SGD(stage.parameters(), lr=0.5)
    load_named_optimizer_state(stage_optimizer, dict(stage.named_parameters()), named)
    restored = stage_optimizer.state_dict()
    assert restored["param_groups"][0]["momentum"] == 0.9 and restored["param_groups"][0]["lr"] == 0.1
    torch.testing.assert_close(restored["state"][0]["momentum_buffer"], named["state"]["1.weight"]["momentum_buffer"])


@pytest.mark.parametrize(
    ("transport", "use_gpu", "nodes", "expected"),
    [
        ("auto", False, ["a"], "p2p"),
        ("auto", False, ["a", "b"], "p2p"),
        # GPU stages on one node: GPU-to-GPU nccl channels; across nodes p2p, the path tested there.
        ("auto", True, ["a", "a"], "compiled"),
        ("auto", True, ["a", "b"], "p2p"),
        ("actor_calls", True, ["a", "a"], "actor_calls"),
        ("compiled", False, ["a", "b"], "compiled"),
    ],
)
def test_auto_transport_choice(transport, use_gpu, nodes, expected):
    from ray_jobs.pipeline.scaling import PipelineScaling
    from ray_jobs.pipeline.transports import resolve_transport

    assert resolve_transport(PipelineScaling(transport=transport, use_gpu=use_gpu), nodes) == expected


def test_pipeline_scaling_errors():
    from ray_jobs.pipeline.scaling import PipelineScaling

    with pytest.raises(ValueError, match="--batches-per-call must be at least 1, got 0"):
        PipelineScaling(batches_per_call=0)


def test_data_parallel_pipeline_grid_is_laid_out_stage_by_stage_and_refused_where_it_cannot_be_exact():
    from ray_jobs.core.config import TrainConfig
    from ray_jobs.driver.resources import ResourceError, check_bundles
    from ray_jobs.pipeline.scaling import PipelineScaling

    grid = PipelineScaling(num_stages=3, data_parallel=2)
    # A stage's copies are neighbouring bundles: PACK keeps them on one node while they fit.
    assert [grid.bundle_index(r, s) for s in range(3) for r in range(2)] == list(range(6))
    assert len(grid.bundles) == grid.num_actors == 6
    with pytest.raises(ResourceError, match=r"^6 stage actors \(--num-stages 3 x --data-parallel 2\) asks for 6 CPU"):
        check_bundles(grid.bundles, "PACK", grid.request, nodes=[{"CPU": 4.0}])
    with pytest.raises(ValueError, match="--data-parallel 2 needs --transport p2p, not compiled"):
        PipelineScaling(data_parallel=2, transport="compiled")
    with pytest.raises(ValueError, match="--data-parallel must be at least 1, got 0"):
        PipelineScaling(data_parallel=0)
    with pytest.raises(ValueError, match=r"--batch-size 12 must divide into --data-parallel 2 shares .* multiple of 8"):
        PipelineScaling(num_microbatches=4, data_parallel=2).check(TrainConfig(batch_size=12))
    PipelineScaling(num_microbatches=4, data_parallel=2).check(TrainConfig(batch_size=16))


def test_checkpoint_mode_is_sync_or_async():
    from ray_jobs.core.config import TrainConfig

    assert TrainConfig().checkpoint_mode == "sync"
    with pytest.raises(ValueError, match="--checkpoint-mode"):
        TrainConfig(checkpoint_mode="later")
