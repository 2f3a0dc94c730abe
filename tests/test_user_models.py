"""``--model module.path:callable``: a user's own model, trained by every strategy to the reference."""
from __future__ import annotations

import json
import struct
import textwrap
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from torch import nn

from models import build_model, not_reproducible_layers, split_into_stages
from ray_jobs import ddp, pipeline, validation
from ray_jobs.config import TrainConfig, parse_model_options
from ray_jobs.runner import prepare
from ray_jobs.training import warn_not_reproducible
from ray_jobs.data import synthesize, table_to_dataset, write_table
from tests.helpers import (assert_same_weights, load_weights, plain_validation, reference_for, run_strategy,
                           tensors, with_)

# A user's model file: an nn.Sequential whose children nest (a block of two layers), built from
# options of every kind --model-option parses (int, string, bool).
USER_MODEL = """
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


def build(in_features, out_features, hidden=4, act="relu", bias=True):
    return nn.Sequential(
        nn.Linear(in_features, hidden, bias=bias),
        ACTIVATIONS[act](),
        nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()),
        nn.Linear(hidden, out_features),
    )


def not_a_model(in_features, out_features):
    return 42


def fails(in_features, out_features, **options):
    raise RuntimeError("widths too small")


class Residual(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.fc(x)


def with_layers_ddp_cannot_match(in_features, out_features):
    return nn.Sequential(nn.Linear(in_features, 4), nn.BatchNorm1d(4), nn.Dropout(0.2), nn.Linear(4, out_features))
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A module of its own name (so no other test's import is cached) on the driver's path."""
    name = f"user_model_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_model_options_parse_as_int_float_bool_or_string():
    assert parse_model_options(["hidden=8", "scale=0.5", "bias=false", "norm=True", "act=gelu", "tag="]) == {
        "hidden": 8, "scale": 0.5, "bias": False, "norm": True, "act": "gelu", "tag": ""}


def test_hidden_is_short_for_a_model_option():
    cfg = TrainConfig(model="pkg.mod:build", hidden=8, model_option=["act=tanh"])
    assert cfg.model_options == {"act": "tanh", "hidden": 8}
    assert TrainConfig(model="mlp", model_option=["depth=2"]).model_options == {"depth": 2}


def test_a_user_model_is_built_with_its_options(user_module):
    model = build_model(f"{user_module}:build", 6, 3, hidden=5, act="tanh", bias=False)
    assert isinstance(model[1], nn.Tanh) and model[0].bias is None and model[3].in_features == 5


def test_split_cuts_any_sequential_between_its_top_level_children(user_module):
    torch.manual_seed(0)
    model = build_model(f"{user_module}:build", 6, 3, hidden=5)
    x = torch.randn(4, 6)
    for num_stages in (2, 3):
        stages = split_into_stages(model, num_stages)
        out = x
        for stage in stages:
            out = stage(out)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)  # the same modules, in the same order
        keys = [key for stage in stages for key in stage.state_dict()]
        assert keys == list(model.state_dict())


def test_split_says_what_a_model_must_be(user_module):
    with pytest.raises(ValueError, match="cuts a model between the children of an nn.Sequential; the model is a "
                                         "Residual: return an nn.Sequential"):
        split_into_stages(build_model(f"{user_module}:Residual", 6, 3), 2)


def test_layers_data_parallelism_cannot_match_are_named(user_module):
    model = build_model(f"{user_module}:with_layers_ddp_cannot_match", 6, 3)
    assert [layer for layer, _, _ in not_reproducible_layers(model)] == ["1 (BatchNorm1d)", "2 (Dropout)"]
    assert not_reproducible_layers(build_model("mlp", 6, 3, dropout=0.0)) == []


@pytest.mark.parametrize(("model", "options", "message"), [
    ("nosuch_module_xyz:thing", [], "error: --model nosuch_module_xyz:thing: no module 'nosuch_module_xyz' in the "
                                    "working directory"),
    ("{module}:missing", [], "error: --model {module}:missing: module {module} ("),
    ("{module}:ACTIVATIONS", [], "has a non-callable 'ACTIVATIONS'; name a function or class"),
    ("{module}:not_a_model", [], "error: --model {module}:not_a_model: (6, 3) returned int, not a torch.nn.Module"),
    ("{module}:fails", [], "error: --model {module}:fails: calling it as (6, 3) raised RuntimeError: widths too small"),
    ("{module}:build", ["--model-option", "width=3"], "raised TypeError: build() got an unexpected keyword"),
    ("{module}:build", ["--model-option", "hidden"], "error: --model-option 'hidden' must be KEY=VALUE"),
    ("{module}:build", ["--model-option", "hidden=3", "--hidden", "4"], "error: --hidden and --model-option hidden"),
    ("{module}", [], "error: --model '{module}' is unknown; valid models: mlp, seed-linear, seed-mlp, seed-split, "
                     "or module.path:callable"),
])
def test_bad_models_are_one_error_line(user_module, regression_data, tmp_path, capsys, model, options, message):
    model, message = model.format(module=user_module), message.format(module=user_module)
    argv = ["--model", model, *options, "--data", regression_data, "--storage-path", str(tmp_path / "runs")]
    assert ddp.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_a_model_the_pipeline_cannot_cut_is_refused_before_ray(user_module, regression_data, tmp_path, capsys):
    argv = ["--model", f"{user_module}:Residual", "--data", regression_data, "--storage-path", str(tmp_path)]
    assert pipeline.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the model is a Residual: return an nn.Sequential" in err[0]


def test_sync_batchnorm_needs_a_gpu(capsys):
    assert ddp.main(["--sync-batchnorm"]) == 2
    assert "--sync-batchnorm needs --use-gpu: SyncBatchNorm runs on CUDA only" in capsys.readouterr().err


def run_and_compare(strategy: str, cfg: TrainConfig, size: int, **pipeline_options) -> dict:
    """Train ``cfg`` with ``strategy`` at ``size`` workers or stages; check the weights, the losses and
    every epoch's validation against plain PyTorch; returns the summary record."""
    scaling = pipeline.PipelineScaling(num_stages=size, num_microbatches=4, **pipeline_options) \
        if strategy == "pipeline" else None
    summary = run_strategy(strategy, cfg, size, scaling)
    expected_weights, expected_losses = reference_for(cfg)
    assert_same_weights(load_weights(summary.run_dir), expected_weights)
    assert summary.losses == pytest.approx(expected_losses, rel=1e-5)  # all-reduce order, as in assert_same_weights
    record = json.loads((Path(summary.run_dir) / "summary.json").read_text())
    build_model(**record["model"]).load_state_dict(load_weights(summary.run_dir))  # the summary alone rebuilds it
    val_x, val_y, _ = tensors(cfg.val_data)
    expected = [plain_validation(record["model"], reference_for(with_(cfg, epochs=epoch))[0], val_x, val_y)
                for epoch in range(1, cfg.epochs + 1)]
    # float32 whole-set mean vs float64 chunk sums, of weights equal to float tolerance
    assert record["val_losses"] == pytest.approx([loss for loss, _ in expected], rel=1e-5)
    classification = val_y.dtype == torch.int64
    assert record["val_accuracy"] == ([accuracy for _, accuracy in expected] if classification else None)
    best = min(range(cfg.epochs), key=lambda epoch: record["val_losses"][epoch])
    assert record["best_epoch"] == best + 1
    assert_same_weights(torch.load(Path(summary.run_dir) / "best_model.pt", weights_only=True),
                        reference_for(with_(cfg, epochs=best + 1))[0])
    check_tensorboard(summary.run_dir, record, cfg)
    return record


def check_tensorboard(run_dir: str, record: dict, cfg: TrainConfig) -> None:
    """The event files hold what summary.json holds, per epoch (x = 1-based epoch), and every global
    batch's loss (x = global step); TensorBoard stores float32."""
    found = scalars(run_dir)
    epochs = list(range(1, cfg.epochs + 1))
    for tag, values in (("train/epoch_loss", record["losses"]), ("val/loss", record["val_losses"]),
                        ("val/accuracy", record["val_accuracy"]), ("lr", [cfg.lr] * cfg.epochs)):
        if values is None:
            assert tag not in found
            continue
        assert [step for step, _ in found[tag]] == epochs, tag
        assert [value for _, value in found[tag]] == pytest.approx(values, rel=1e-6), tag
    assert [step for step, _ in found["perf/samples_per_second"]] == epochs
    assert all(value > 0 for _, value in found["perf/samples_per_second"])
    steps = 96 // cfg.batch_size
    assert [step for step, _ in found["train/loss"]] == list(range(1, cfg.epochs * steps + 1))
    per_epoch = [sum(value for step, value in found["train/loss"] if (step - 1) // steps == epoch) / steps
                 for epoch in range(cfg.epochs)]
    assert per_epoch == pytest.approx(record["losses"], rel=1e-6)


def scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from the run's event files (TFRecord framing: length, its
    CRC, an ``Event`` protobuf, its CRC), read with tensorboardX's own protobuf classes."""
    from tensorboardX.proto import event_pb2

    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((Path(run_dir) / "tensorboard").glob("events.out.tfevents.*")):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


@pytest.fixture
def user_cfg(user_module, request, tmp_path):
    """The user model's run: its task's training data, 40 validation rows of the same kind."""
    task = getattr(request, "param", "classification")
    val_data = str(tmp_path / "val.parquet")
    write_table(synthesize(rows=40, in_features=6, out_features=4 if task == "classification" else 3, task=task,
                           seed=9), val_data)
    return TrainConfig(model=f"{user_module}:build", model_option=["act=tanh", "bias=true"], hidden=5,
                       data=request.getfixturevalue(f"{task}_data"), val_data=val_data, epochs=2, batch_size=16,
                       seed=3, storage_path=str(tmp_path / "runs"))


@pytest.mark.ray
def test_ddp_trains_a_user_model_and_validates_it_alike_with_1_and_2_workers(ray_cluster, user_cfg):
    """The workers cannot import the test's module (it is on this process's path only): the model's
    code reaches them by value."""
    one, two = (run_and_compare("ddp", with_(user_cfg, name=f"ddp{size}"), size) for size in (1, 2))
    # the two runs' weights differ by all-reduce rounding only; the evaluation itself is the same
    assert two["val_losses"] == pytest.approx(one["val_losses"], rel=1e-6)
    assert two["val_accuracy"] == one["val_accuracy"]


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


def test_validation_is_the_same_bits_for_any_worker_count(monkeypatch):
    """Chunks fixed whatever the worker count, summed in chunk order: 1, 2 or 3 ranks' shares
    combine to exactly the one-process result, which equals plain PyTorch to float rounding."""
    monkeypatch.setattr(validation, "CHUNK_ROWS", 16)
    val = table_to_dataset(synthesize(rows=70, in_features=6, out_features=4, task="classification", seed=5))
    torch.manual_seed(0)
    model = build_model("mlp", 6, 4, hidden=8, depth=3)
    whole = validation.validate(model, val, torch.device("cpu"))
    for world_size in (1, 2, 3):
        shares = [validation.chunk_sums(model, val, validation.my_chunks(val, rank, world_size), torch.device("cpu"))
                  for rank in range(world_size)]
        assert validation.combine({k: v for share in shares for k, v in share.items()}, val) == whole
    x, y = val.tensors()
    with torch.no_grad():
        out = model(x)
    assert whole.loss == pytest.approx(nn.CrossEntropyLoss()(out, y).item(), rel=1e-6)  # float32 mean vs float64 sums
    assert whole.accuracy == (out.argmax(dim=1) == y).double().mean().item()


def test_a_streamed_validation_set_gives_the_same_bits_as_in_memory(monkeypatch, tmp_path):
    """Chunks of 16 rows over row groups of 7: chunks straddle row groups, and each rank reads only
    the row groups under its chunks."""
    monkeypatch.setattr(validation, "CHUNK_ROWS", 16)
    path = str(tmp_path / "val.parquet")
    write_table(synthesize(rows=70, in_features=6, out_features=4, task="classification", seed=5), path,
                row_group_rows=7)
    train = table_to_dataset(synthesize(rows=8, in_features=6, out_features=4, task="classification", seed=6))
    in_memory = validation.read_val_data(path, "features", "target", train)
    streamed = validation.read_val_data(path, "features", "target", train, stream=True)
    assert streamed.ingest == "stream" and len(streamed.blocks) == 10
    torch.manual_seed(0)
    model = build_model("mlp", 6, 4, hidden=8, depth=3)
    whole = validation.validate(model, in_memory, torch.device("cpu"))
    assert validation.validate(model, streamed, torch.device("cpu")) == whole
    for world_size in (2, 3):
        shares = [validation.chunk_sums(model, streamed, validation.my_chunks(streamed, rank, world_size),
                                        torch.device("cpu")) for rank in range(world_size)]
        assert validation.combine({k: v for share in shares for k, v in share.items()}, streamed) == whole


def test_a_bad_row_group_of_a_streamed_validation_set_is_named(tmp_path):
    path = str(tmp_path / "val.parquet")
    table = synthesize(rows=20, in_features=6, out_features=3, task="regression", seed=5)
    features = table.column("features").to_pylist()
    features[15] = features[15][:5]  # one short row, in the third row group
    write_table(table.set_column(0, "features", pa.array(features, pa.list_(pa.float32()))), path, row_group_rows=7)
    train = table_to_dataset(synthesize(rows=8, in_features=6, out_features=3, task="regression", seed=6))
    streamed = validation.read_val_data(path, "features", "target", train, stream=True)
    with pytest.raises(ValueError, match=f"--val-data {path} row group 2: "):
        validation.validate(build_model("mlp", 6, 3, hidden=4, depth=2), streamed, torch.device("cpu"))


def test_val_data_must_match_the_training_data(regression_data, classification_data, tmp_path, capsys):
    argv = ["--data", regression_data, "--val-data", classification_data, "--storage-path", str(tmp_path)]
    assert ddp.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --val-data" in err[0], err
    assert ddp.main(["--data", regression_data, "--val-data", str(tmp_path / "none.parquet")]) == 2
    assert f"error: --val-data {tmp_path / 'none.parquet'}: no such file" in capsys.readouterr().err


def test_ddp_warns_once_naming_the_layers_it_cannot_match(user_module, regression_data, tmp_path):
    cfg = TrainConfig(model=f"{user_module}:with_layers_ddp_cannot_match", data=regression_data,
                      storage_path=str(tmp_path))
    prepared = prepare(cfg, "ddp")
    with pytest.warns(UserWarning) as caught:
        warn_not_reproducible(cfg, prepared.dataset, prepared.model_factory, "DDP")
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "DDP trains this model but cannot match single-process weights: 1 (BatchNorm1d) normalises over each "
        "worker's shard of the batch, not the global batch; 2 (Dropout) draws a random mask on each worker")
    with pytest.warns(UserWarning, match="2 \\(Dropout\\)") as caught:  # SyncBatchNorm (GPU) covers BatchNorm
        warn_not_reproducible(cfg, prepared.dataset, prepared.model_factory, "DDP", (nn.modules.batchnorm._BatchNorm,))
    assert "BatchNorm" not in str(caught[0].message)


def test_val_data_with_a_streamed_training_set(regression_data, tmp_path):
    cfg = TrainConfig(data=regression_data, val_data=regression_data, ingest="stream", storage_path=str(tmp_path))
    prepared = prepare(cfg, "ddp")
    assert prepared.dataset.ingest == "stream" and prepared.val_dataset.num_rows == 96
