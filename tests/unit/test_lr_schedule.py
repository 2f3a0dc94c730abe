"""--lr-schedule, --warmup-steps, --min-lr: one formula, checked against a second writing of it
(tests/reference.py) and against torch's LambdaLR stepped as a plain loop steps it. No Ray."""

from __future__ import annotations

import pytest
import torch

from ray_jobs import ddp
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.lr_schedule import LRSchedule
from tests.reference import lr_at

CASES = [("constant", 0, 0.0), ("constant", 3, 0.0), ("cosine", 0, 0.0), ("cosine", 4, 0.01), ("linear", 5, 0.002)]


@pytest.mark.parametrize(("schedule", "warmup", "min_lr"), CASES)
def test_every_steps_lr_is_the_formulas_and_lambdalrs(schedule, warmup, min_lr):
    total, lr = 24, 0.1
    ours = LRSchedule(lr, schedule, warmup, min_lr, total)
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=lr)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, total, lr, schedule, warmup, min_lr) / lr
    )
    for step in range(total):
        assert ours.at(step) == pytest.approx(lr_at(step, total, lr, schedule, warmup, min_lr), rel=1e-12)
        # LambdaLR scales the base LR by the factor: the same to the last bits or one rounding off.
        assert optimizer.param_groups[0]["lr"] == pytest.approx(ours.at(step), rel=1e-15)
        optimizer.step()
        lambda_lr.step()
    if schedule != "constant":  # the decay ends near --min-lr: one step short of it
        assert min_lr <= ours.at(total - 1) < min_lr + (lr - min_lr) / 2


def test_constant_without_warmup_is_the_flag_itself_bit_for_bit():
    schedule = LRSchedule(0.05, "constant", 0, 0.0, 10)
    assert all(schedule.at(step) == 0.05 for step in range(10))
    assert schedule.readings() == {"first": 0.05, "peak": 0.05, "last": 0.05}


def test_warmup_ramps_then_the_peak_is_the_flag():
    readings = LRSchedule(0.1, "cosine", 4, 0.0, 12).readings()
    assert readings["first"] == pytest.approx(0.025) and readings["peak"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr_schedule": "step"}, "--lr-schedule 'step' is unknown; valid: constant, cosine, linear"),
        ({"warmup_steps": -1}, "--warmup-steps must be zero or more, got -1"),
        ({"min_lr": 0.5}, "--min-lr must be between 0 and --lr 0.05, got 0.5"),
        ({"min_lr": -0.1}, "--min-lr must be between 0 and --lr 0.05, got -0.1"),
    ],
)
def test_bad_values_are_one_line(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**options)


def test_a_warmup_longer_than_the_run_is_refused_before_ray(regression_data, tmp_path, capsys):
    argv = ["--data", regression_data, "--batch-size", "16", "--epochs", "2", "--warmup-steps", "13"]
    assert ddp.main([*argv, "--storage-path", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --warmup-steps 13 is longer than the run's 12 optimizer steps (--epochs 2 x 6 global batches): "
        "the LR would never reach --lr 0.05"
    )
