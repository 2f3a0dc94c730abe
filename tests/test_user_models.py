"""``--model module.path:callable``: a user's own model, trained by every strategy to the reference."""
from __future__ import annotations

import json
import textwrap
import uuid

import pytest
import torch
from torch import nn

from models import build_model, not_reproducible_layers, split_into_stages
from ray_jobs import ddp, pipeline
from ray_jobs.config import TrainConfig, parse_model_options
from tests.helpers import assert_same_weights, load_weights, reference_for, run_strategy

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


@pytest.mark.ray
@pytest.mark.parametrize(("strategy", "size"), [("ddp", 1), ("ddp", 2), ("dp", 1), ("pipeline", 2), ("pipeline", 3)])
def test_a_user_model_trains_to_the_reference(ray_cluster, user_module, regression_data, tmp_path, strategy, size):
    """The workers and stages cannot import the test's module (it is on this process's path only):
    the model's code reaches them by value."""
    cfg = TrainConfig(model=f"{user_module}:build", model_option=["act=tanh", "bias=true"], hidden=5,
                      data=regression_data, epochs=2, batch_size=16, seed=3, storage_path=str(tmp_path), name="run")
    scaling = pipeline.PipelineScaling(num_stages=size, num_microbatches=4) if strategy == "pipeline" else None
    summary = run_strategy(strategy, cfg, size, scaling)
    expected_weights, expected_losses = reference_for(cfg)
    assert_same_weights(load_weights(summary.run_dir), expected_weights)
    assert summary.losses == pytest.approx(expected_losses, rel=1e-5)  # all-reduce order, as in assert_same_weights
    record = json.loads((tmp_path / "run" / "summary.json").read_text())["model"]
    assert record == {"name": f"{user_module}:build", "in_features": 6, "out_features": 3, "act": "tanh",
                      "bias": True, "hidden": 5}
    build_model(**record).load_state_dict(load_weights(summary.run_dir))  # the summary alone rebuilds model.pt
