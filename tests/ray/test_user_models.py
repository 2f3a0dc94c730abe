"""``--model module.path:callable``: a user's own model, trained by every strategy to the reference."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from models import build_model
from ray_jobs.core.config import TrainConfig
from ray_jobs.data.parquet import synthesize, write_table
from ray_jobs.pipeline import trainer as pipeline
from tests.helpers import (
    assert_same_weights,
    assert_trains_the_reference,
    load_weights,
    plain_validation,
    reference_for,
    run_strategy,
    tensors,
    with_,
)


def run_and_compare(strategy: str, cfg: TrainConfig, size: int, **pipeline_options) -> dict:
    """Train ``cfg`` with ``strategy`` at ``size`` workers or stages; check the weights, the losses and
    every epoch's validation against plain PyTorch; returns the summary record."""
    scaling = (
        pipeline.PipelineScaling(num_stages=size, num_microbatches=4, **pipeline_options)
        if strategy == "pipeline"
        else None
    )
    summary = run_strategy(strategy, cfg, size, scaling)
    assert_trains_the_reference(summary, cfg)
    record = json.loads((Path(summary.run_dir) / "summary.json").read_text())
    build_model(**record["model"]).load_state_dict(load_weights(summary.run_dir))  # the summary alone rebuilds it
    val_x, val_y, _ = tensors(cfg.val_data)
    expected = [
        plain_validation(record["model"], reference_for(with_(cfg, epochs=epoch))[0], val_x, val_y)
        for epoch in range(1, cfg.epochs + 1)
    ]
    # float32 whole-set mean vs float64 chunk sums, of weights equal to float tolerance
    assert record["val_losses"] == pytest.approx([loss for loss, _ in expected], rel=1e-5)
    classification = val_y.dtype == torch.int64
    assert record["val_accuracy"] == ([accuracy for _, accuracy in expected] if classification else None)
    best = min(range(cfg.epochs), key=lambda epoch: record["val_losses"][epoch])
    assert record["best_epoch"] == best + 1
    assert_same_weights(
        torch.load(Path(summary.run_dir) / "best_model.pt", weights_only=True),
        reference_for(with_(cfg, epochs=best + 1))[0],
    )
    check_tensorboard(summary.run_dir, record, cfg)
    return record


def check_tensorboard(run_dir: str, record: dict, cfg: TrainConfig) -> None:
    """The event files hold what summary.json holds, per epoch (x = 1-based epoch), and every global
    batch's loss (x = global step); TensorBoard stores float32."""
    found = scalars(run_dir)
    epochs = list(range(1, cfg.epochs + 1))
    for tag, values in (
        ("train/epoch_loss", record["losses"]),
        ("val/loss", record["val_losses"]),
        ("val/accuracy", record["val_accuracy"]),
        ("lr", [cfg.lr] * cfg.epochs),
    ):
        if values is None:
            assert tag not in found
            continue
        assert [step for step, _ in found[tag]] == epochs, tag
        assert [value for _, value in found[tag]] == pytest.approx(values, rel=1e-6), tag
    assert [step for step, _ in found["perf/samples_per_second"]] == epochs
    assert all(value > 0 for _, value in found["perf/samples_per_second"])
    steps = 96 // cfg.batch_size
    assert [step for step, _ in found["train/loss"]] == list(range(1, cfg.epochs * steps + 1))
    per_epoch = [
        sum(value for step, value in found["train/loss"] if (step - 1) // steps == epoch) / steps
        for epoch in range(cfg.epochs)
    ]
    assert per_epoch == pytest.approx(record["losses"], rel=1e-6)
    # every global batch's LR beside its loss (--lr-schedule; constant here)
    assert [step for step, _ in found["train/lr"]] == list(range(1, cfg.epochs * steps + 1))
    assert [value for _, value in found["train/lr"]] == pytest.approx([cfg.lr] * cfg.epochs * steps, rel=1e-6)


def scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from the run's event files (TFRecord framing: length, its
    CRC, an ``Event`` protobuf, its CRC), read with tensorboardX's own protobuf classes."""
    from tensorboardX.proto import event_pb2

    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((Path(run_dir) / "tensorboard").glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


@pytest.fixture
def user_cfg(user_module, request, tmp_path):
    """The user model's run: its task's training data, 40 validation rows of the same kind."""
    task = getattr(request, "param", "classification")
    val_data = str(tmp_path / "val.parquet")
    write_table(
        synthesize(rows=40, in_features=6, out_features=4 if task == "classification" else 3, task=task, seed=9),
        val_data,
    )
    return TrainConfig(
        model=f"{user_module}:build",
        model_option=["act=tanh", "bias=true"],
        hidden=5,
        data=request.getfixturevalue(f"{task}_data"),
        val_data=val_data,
        epochs=2,
        batch_size=16,
        seed=3,
        storage_path=str(tmp_path / "runs"),
    )


@pytest.mark.ray
def test_ddp_trains_a_user_model_and_validates_it_as_one_process_does(ray_cluster, user_cfg):
    """The workers cannot import the test's module (it is on this process's path only): the model's
    code reaches them by value. Each epoch's validation is plain PyTorch's (``run_and_compare``),
    whatever the worker count: the chunks and their sums are the same for any count
    (tests/unit/test_user_models.py, bit for bit)."""
    run_and_compare("ddp", with_(user_cfg, name="ddp2"), 2)


@pytest.mark.ray
def test_fsdp_trains_a_user_model_and_validates_it_on_2_workers(ray_cluster, user_cfg):
    """40 validation rows are one chunk: world rank 1 has none, and still joins the forward's
    all-gathers; best_model.pt is gathered from both ranks' shards."""
    run_and_compare("fsdp", with_(user_cfg, name="fsdp2"), 2)


@pytest.mark.ray
@pytest.mark.parametrize("user_cfg", ["regression"], indirect=True)
def test_dataparallel_trains_a_user_model(ray_cluster, user_cfg):
    assert run_and_compare("dp", with_(user_cfg, name="dp"), 1)["val_accuracy"] is None


@pytest.mark.ray
def test_the_pipeline_cuts_a_user_model_and_validation_survives_a_resume(ray_cluster, user_cfg):
    """Two epochs on 2 stages, then a re-run of the name on 3 stages, cut by measured time, trains
    the third: a checkpoint is the whole model's, whatever the cut."""
    first = run_and_compare("pipeline", with_(user_cfg, name="pipe"), 2)
    resumed = run_and_compare("pipeline", with_(user_cfg, name="pipe", epochs=3), 3, stage_balance="time")
    assert resumed["resumed_from_epoch"] == 2
    assert first["stage_children"] == [["0", "1"], ["2", "3"]]  # by parameters: 35 against 30 + 24
    assert [name for children in resumed["stage_children"] for name in children] == ["0", "1", "2", "3"]
    assert resumed["val_losses"][:2] == first["val_losses"]  # kept from the checkpoint, not recomputed
