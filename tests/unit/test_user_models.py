"""``--model module.path:callable`` before Ray: options, building, cutting, the one-line errors,
the layers DDP cannot match, and validation's bits for any worker count."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from torch import nn

from models import build_model, not_reproducible_layers, split_into_stages
from ray_jobs import ddp
from ray_jobs.core import evaluation as validation
from ray_jobs.core.config import TrainConfig, parse_model_options
from ray_jobs.core.model_init import warn_not_reproducible
from ray_jobs.data.parquet import synthesize, table_to_dataset, write_table
from ray_jobs.driver.prepare import prepare
from ray_jobs.pipeline import trainer as pipeline


def test_model_options_parse_as_int_float_bool_or_string():
    assert parse_model_options(["hidden=8", "scale=0.5", "bias=false", "norm=True", "act=gelu", "tag="]) == {
        "hidden": 8,
        "scale": 0.5,
        "bias": False,
        "norm": True,
        "act": "gelu",
        "tag": "",
    }


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
    with pytest.raises(
        ValueError,
        match="cuts a model between the children of an nn.Sequential; the model is a Residual: return an nn.Sequential",
    ):
        split_into_stages(build_model(f"{user_module}:Residual", 6, 3), 2)


def test_layers_data_parallelism_cannot_match_are_named(user_module):
    model = build_model(f"{user_module}:with_layers_ddp_cannot_match", 6, 3)
    assert [layer for layer, _, _ in not_reproducible_layers(model)] == ["1 (BatchNorm1d)", "2 (Dropout)"]
    assert not_reproducible_layers(build_model("mlp", 6, 3, dropout=0.0)) == []


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        (
            "nosuch_module_xyz:thing",
            [],
            "error: --model nosuch_module_xyz:thing: no module 'nosuch_module_xyz' in the working directory",
        ),
        ("{module}:missing", [], "error: --model {module}:missing: module {module} ("),
        ("{module}:ACTIVATIONS", [], "has a non-callable 'ACTIVATIONS'; name a function or class"),
        ("{module}:not_a_model", [], "error: --model {module}:not_a_model: (6, 3) returned int, not a torch.nn.Module"),
        (
            "{module}:fails",
            [],
            "error: --model {module}:fails: calling it as (6, 3) raised RuntimeError: widths too small",
        ),
        ("{module}:build", ["--model-option", "width=3"], "raised TypeError: build() got an unexpected keyword"),
        ("{module}:build", ["--model-option", "hidden"], "error: --model-option 'hidden' must be KEY=VALUE"),
        (
            "{module}:build",
            ["--model-option", "hidden=3", "--hidden", "4"],
            "error: --hidden and --model-option hidden",
        ),
        (
            "{module}",
            [],
            "error: --model '{module}' is unknown; valid models: gpt, mlp, seed-linear, seed-mlp, seed-split, "
            "or module.path:callable",
        ),
    ],
)
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


def test_validation_is_the_same_bits_for_any_worker_count(monkeypatch):
    """Chunks fixed whatever the worker count, summed in chunk order: 1, 2 or 3 ranks' shares
    combine to exactly the one-process result, which equals plain PyTorch to float rounding."""
    monkeypatch.setattr(validation, "CHUNK_ROWS", 16)
    val = table_to_dataset(synthesize(rows=70, in_features=6, out_features=4, task="classification", seed=5))
    torch.manual_seed(0)
    model = build_model("mlp", 6, 4, hidden=8, depth=3)
    whole = validation.validate(model, val, torch.device("cpu"))
    for world_size in (1, 2, 3):
        shares = [
            validation.chunk_sums(model, val, validation.my_chunks(val, rank, world_size), torch.device("cpu"))
            for rank in range(world_size)
        ]
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
    write_table(
        synthesize(rows=70, in_features=6, out_features=4, task="classification", seed=5), path, row_group_rows=7
    )
    train = table_to_dataset(synthesize(rows=8, in_features=6, out_features=4, task="classification", seed=6))
    in_memory = validation.read_val_data(path, "features", "target", train)
    streamed = validation.read_val_data(path, "features", "target", train, stream=True)
    assert streamed.ingest == "stream" and len(streamed.blocks) == 10
    torch.manual_seed(0)
    model = build_model("mlp", 6, 4, hidden=8, depth=3)
    whole = validation.validate(model, in_memory, torch.device("cpu"))
    assert validation.validate(model, streamed, torch.device("cpu")) == whole
    for world_size in (2, 3):
        shares = [
            validation.chunk_sums(
                model, streamed, validation.my_chunks(streamed, rank, world_size), torch.device("cpu")
            )
            for rank in range(world_size)
        ]
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
    cfg = TrainConfig(
        model=f"{user_module}:with_layers_ddp_cannot_match", data=regression_data, storage_path=str(tmp_path)
    )
    prepared = prepare(cfg, "ddp")
    with pytest.warns(UserWarning) as caught:
        warn_not_reproducible(cfg, prepared.dataset, prepared.model_factory, "DDP")
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "DDP trains this model but cannot match single-process weights: 1 (BatchNorm1d) normalises over each "
        "worker's shard of the batch, not the global batch; 2 (Dropout) draws a random mask on each worker"
    )
    with pytest.warns(UserWarning, match="2 \\(Dropout\\)") as caught:  # SyncBatchNorm (GPU) covers BatchNorm
        warn_not_reproducible(cfg, prepared.dataset, prepared.model_factory, "DDP", (nn.modules.batchnorm._BatchNorm,))
    assert "BatchNorm" not in str(caught[0].message)


@pytest.mark.parametrize(
    ("depth", "layers"),
    [
        (25, "24 layers (dropout0 (Dropout), dropout1 (Dropout), dropout2 (Dropout), …)"),
        (4, "3 layers (dropout0 (Dropout), dropout1 (Dropout), dropout2 (Dropout))"),
    ],
)
def test_many_layers_of_one_reason_are_counted_not_listed(regression_data, tmp_path, depth, layers):
    cfg = TrainConfig(model="mlp", depth=depth, dropout=0.1, data=regression_data, storage_path=str(tmp_path))
    prepared = prepare(cfg, "ddp")
    with pytest.warns(UserWarning) as caught:
        warn_not_reproducible(cfg, prepared.dataset, prepared.model_factory, "DDP")
    assert len(caught) == 1
    assert str(caught[0].message) == (
        f"DDP trains this model but cannot match single-process weights: {layers}: each draws a random mask on "
        "each worker"
    )


def test_val_data_with_a_streamed_training_set(regression_data, tmp_path):
    cfg = TrainConfig(data=regression_data, val_data=regression_data, ingest="stream", storage_path=str(tmp_path))
    prepared = prepare(cfg, "ddp")
    assert prepared.dataset.ingest == "stream" and prepared.val_dataset.num_rows == 96
