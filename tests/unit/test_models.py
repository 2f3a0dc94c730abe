"""The model registry and stage splitting: pure torch, no Ray."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from models import build_model, split_into_stages, unit_names, unit_seconds


@pytest.mark.parametrize(
    ("name", "in_features", "out_features", "keys"),
    [
        ("seed-linear", 5, 2, ["fc.weight", "fc.bias"]),
        ("seed-mlp", 10, 5, ["net1.weight", "net1.bias", "net2.weight", "net2.bias"]),
        ("seed-split", 10, 5, ["net1.weight", "net1.bias", "net2.weight", "net2.bias"]),
    ],
)
def test_tutorial_models_have_the_tutorial_names(name, in_features, out_features, keys):
    model = build_model(name, in_features, out_features)
    assert list(model.state_dict()) == keys
    assert model(torch.randn(3, in_features)).shape == (3, out_features)


def test_tutorial_hidden_widths():
    assert build_model("seed-mlp", 10, 5).net1.out_features == 10
    assert build_model("seed-split", 10, 5).net1.out_features == 5
    assert isinstance(build_model("seed-split", 10, 5).relu, torch.nn.LeakyReLU)
    assert build_model("seed-mlp", 10, 5, hidden=7).net2.in_features == 7


def test_mlp_depth_and_width():
    model = build_model("mlp", 4, 3, hidden=16, depth=5)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(4, 16)] + [(16, 16)] * 3 + [(16, 3)]


def test_same_seed_same_weights():
    torch.manual_seed(3)
    first = build_model("mlp", 4, 3, depth=3)
    torch.manual_seed(3)
    second = build_model("mlp", 4, 3, depth=3)
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("args", "options", "message"),
    [
        (("resnet", 4, 2), {}, "unknown model 'resnet'; valid models: gpt, mlp, seed-linear, seed-mlp, seed-split"),
        (("seed-linear", 4, 2), {"hidden": 8}, "does not take --hidden; its options: none"),
        (("seed-mlp", 4, 2), {"depth": 3}, "does not take --depth; its options: --hidden"),
        (("mlp", 0, 2), {}, "in_features must be a positive integer"),
        (("mlp", 4, 2), {"hidden": -1}, "hidden must be a positive integer"),
    ],
)
def test_build_model_errors(args, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_model(*args, **options)


def test_none_options_take_defaults():
    assert build_model("seed-linear", 5, 2, hidden=None, depth=None).fc.out_features == 2


def run_stages(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize(("depth", "num_stages"), [(1, 1), (2, 2), (4, 2), (5, 3), (8, 4), (8, 8)])
def test_split_runs_to_exactly_the_model_output(depth, num_stages):
    torch.manual_seed(0)
    model = build_model("mlp", 6, 3, hidden=12, depth=depth)
    stages = split_into_stages(model, num_stages)
    x = torch.randn(5, 6)
    assert len(stages) == num_stages
    assert torch.equal(run_stages(stages, x), model(x))  # same modules, same ops: bit-identical
    merged = {k: v for stage in stages for k, v in stage.state_dict().items()}
    assert merged.keys() == model.state_dict().keys()


def test_seed_split_cuts_at_its_natural_boundary():
    stages = split_into_stages(build_model("seed-split", 10, 5), 2)
    assert [list(stage.state_dict()) for stage in stages] == [
        ["net1.weight", "net1.bias"],
        ["net2.weight", "net2.bias"],
    ]
    assert isinstance(stages[0][-1], torch.nn.LeakyReLU)  # activation stays with the layer before it


def test_mlp_split_is_balanced_by_parameter_count():
    # Wide first layer: a balanced 2-way cut puts it alone, not half the layers on each side.
    model = build_model("mlp", 1000, 2, hidden=8, depth=4)
    stages = split_into_stages(model, 2)
    assert list(stages[0].state_dict()) == ["fc0.weight", "fc0.bias"]
    sizes = [
        sum(p.numel() for p in s.parameters())
        for s in split_into_stages(build_model("mlp", 8, 8, hidden=8, depth=8), 4)
    ]
    assert sizes == [sizes[0]] * 4


def test_split_by_unit_costs_balances_those_instead():
    model = build_model("mlp", 8, 8, hidden=8, depth=4)  # four layers of 72 parameters
    assert unit_names(model) == [["fc0", "relu0"], ["fc1", "relu1"], ["fc2", "relu2"], ["fc3"]]
    stages = split_into_stages(model, 2, unit_costs=[1.0, 1.0, 1.0, 3.0])
    assert [list(dict(stage.named_children())) for stage in stages] == [
        ["fc0", "relu0", "fc1", "relu1", "fc2", "relu2"],
        ["fc3"],
    ]
    with pytest.raises(ValueError, match="3 unit costs for a model of 4 units"):
        split_into_stages(model, 2, unit_costs=[1.0, 1.0, 1.0])


def test_unit_seconds_times_every_unit_and_leaves_no_gradients():
    model = torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 6)),
        torch.nn.Conv1d(1, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(24, 2),
    )
    seconds = unit_seconds(model, torch.randn(5, 6), repeats=2)
    assert len(seconds) == len(unit_names(model)) == 3 and all(s > 0 for s in seconds)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("depth", "num_stages", "message"), [(3, 4, "more than the model's 3 layers"), (3, 0, "positive")]
)
def test_split_errors(depth, num_stages, message):
    with pytest.raises(ValueError, match=message):
        split_into_stages(build_model("mlp", 4, 2, depth=depth), num_stages)


def test_models_package_never_imports_ray_or_distributed():
    for path in pathlib.Path("models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith("ray"), f"{path} imports {name}"
                assert not name.startswith("torch.distributed"), f"{path} imports {name}"
