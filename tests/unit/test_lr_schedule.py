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


def test_a_clip_norm_must_be_positive_and_the_pipeline_clips_over_p2p_only():
    from ray_jobs.pipeline.scaling import PipelineScaling

    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=f"--grad-clip-norm must be positive, got {bad}"):
            TrainConfig(grad_clip_norm=bad)
    with pytest.raises(ValueError, match="--grad-clip-norm on the pipeline needs --transport p2p, not actor_calls"):
        PipelineScaling(transport="actor_calls").check(TrainConfig(grad_clip_norm=1.0, batch_size=8))


def test_train_step_clips_the_norm_and_returns_it_before_clipping():
    from torch import nn

    from ray_jobs.core.step import train_step

    def run(clip):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        return model, optimizer, train_step(model, optimizer, nn.MSELoss(), x, y, clip_norm=clip), (x, y)

    model, _, result, (x, y) = run(1e-3)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    nn.MSELoss()(plain(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    assert result.grad_norm == norm and norm > 1e-3
    for got, expected in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert run(None)[2].grad_norm is None


def test_accumulated_micro_steps_give_the_one_steps_weights_and_need_equal_chunks():
    from torch import nn

    from ray_jobs.core.config import WorkerScaling
    from ray_jobs.core.step import train_step
    from ray_jobs.pipeline.scaling import PipelineScaling

    def trained(accum_steps):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(1)
        for _ in range(5):
            x, y = torch.randn(16, 4), torch.randn(16, 2)
            loss = train_step(model, optimizer, nn.MSELoss(), x, y, accum_steps=accum_steps).loss
        return model.state_dict(), loss

    (one, loss_one), (four, loss_four) = trained(1), trained(4)
    for key in one:  # four chunk means / 4 vs one mean: float32 summation order only
        torch.testing.assert_close(four[key], one[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_four, loss_one, rtol=1e-5, atol=1e-6)
    with pytest.raises(
        ValueError, match=r"--grad-accum-steps 3 does not divide the per-worker batch \(--batch-size 16 "
    ):
        WorkerScaling(num_workers=2).check(TrainConfig(batch_size=16, grad_accum_steps=3))
    with pytest.raises(ValueError, match="--grad-accum-steps applies to ddp and dp: .* use --num-microbatches 8"):
        PipelineScaling(num_microbatches=4).check(TrainConfig(batch_size=16, grad_accum_steps=2))
