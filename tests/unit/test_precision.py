"""--precision in one process: autocast around the forward and loss, float32 weights and optimizer
state, fp16's gradient scaler in the checkpoint, a stage skipping another's overflowed step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models import build_model
from ray_jobs import ddp, dp
from ray_jobs.core.checkpoint import TrainState, read_checkpoint, restore_scaler, write_checkpoint
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.step import grad_scaler, train_step
from ray_jobs.data_parallel.wrap import ReplicaAutocast
from ray_jobs.pipeline import trainer as pipeline
from ray_jobs.pipeline.stage import mark_overflow, overflowed
from tests.helpers import assert_same_weights
from tests.reference import reference_train

# bf16 runs against the bf16 reference: each worker's (or micro-batch's) weight gradient comes
# out of a bf16 matmul over its own rows, rounded to bf16's 8-bit mantissa before the float32
# all-reduce (or accumulation), where the reference rounds the whole batch's sum once: ~0.4% per
# gradient, compounding over 18 momentum steps. Measured (mlp 12x3): max |diff| 4.4e-4 with 2 DDP
# workers, 5.4e-4 for the pipeline S=2 M=4, while bf16 itself moves these weights 8e-3 from float32,
# so the tolerance still tells a bf16 run from a float32 one (checked below).
BF16_ATOL = 2e-3


def _step(precision: str, scaler=None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = build_model("mlp", 6, 3, hidden=8, depth=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    loss = train_step(model, optimizer, nn.MSELoss(), x, y, precision=precision, scaler=scaler).loss
    return model.state_dict(), loss


def test_fp32_is_the_plain_step_bit_for_bit():
    got, loss = _step("fp32")
    torch.manual_seed(0)
    model = build_model("mlp", 6, 3, hidden=8, depth=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    expected = nn.MSELoss()(model(x), y)
    expected.backward()
    optimizer.step()
    assert_same_weights(got, model.state_dict(), exact=True)
    assert torch.equal(loss, expected.detach())


def test_bf16_autocasts_the_forward_and_keeps_weights_float32():
    got, loss = _step("bf16")
    assert all(value.dtype == torch.float32 for value in got.values())
    assert loss.dtype == torch.float32  # MSELoss runs in float32 under autocast
    assert not all(torch.equal(got[k], v) for k, v in _step("fp32")[0].items())  # bf16 changed the step


def test_fp16_scaler_state_goes_into_the_checkpoint_and_back(tmp_path):
    # fp16 autocast and GradScaler run on CPU too, so the scaler's path is tested here; the flag
    # itself asks for GPUs (test below).
    scaler = grad_scaler("fp16", torch.device("cpu"))
    weights, _ = _step("fp16", scaler)
    assert grad_scaler("bf16", torch.device("cpu")) is None and grad_scaler("fp32", torch.device("cpu")) is None
    scaler.update(1024.0)  # a scale a fresh scaler would not have
    write_checkpoint(str(tmp_path), TrainState(weights, {}, 1, [0.5], scaler=scaler.state_dict()))
    restored = grad_scaler("fp16", torch.device("cpu"))
    restore_scaler(restored, read_checkpoint(str(tmp_path)))
    assert restored.state_dict() == scaler.state_dict() and restored.get_scale() == 1024.0


def test_data_parallel_replicas_autocast_in_the_runs_dtype():
    seen = []
    module = nn.Linear(4, 2)
    module.register_forward_hook(lambda _m, _x, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.float16):  # a replica thread's autocast: on, another dtype
        ReplicaAutocast(module, "bf16")(torch.randn(3, 4))
    assert seen == [torch.bfloat16]


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (ddp.main, [], "error: --precision fp16 needs GPUs (--use-gpu); on CPUs use --precision bf16"),
        (dp.main, [], "error: --precision fp16 needs GPUs (--gpus); on CPUs use --precision bf16"),
        (pipeline.main, [], "error: --precision fp16 needs GPUs (--use-gpu); on CPUs use --precision bf16"),
        (
            pipeline.main,
            ["--use-gpu", "--transport", "compiled"],
            "error: --precision fp16 on the pipeline needs --transport p2p, not compiled",
        ),
    ],
)
def test_fp16_without_gpus_is_one_error_line_before_ray(main, argv, message, capsys, tmp_path):
    assert main(["--precision", "fp16", *argv, "--storage-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="--precision 'fp8' is unknown; valid: fp32, bf16, fp16"):
        TrainConfig(precision="fp8")


def test_the_reference_autocasts_only_when_asked(regression_data):
    from tests.helpers import tensors

    features, targets, out_features = tensors(regression_data)
    kwargs = dict(
        model="seed-linear",
        features=features,
        targets=targets,
        out_features=out_features,
        epochs=1,
        batch_size=16,
        lr=0.05,
        seed=0,
    )
    assert_same_weights(reference_train(**kwargs)[0], reference_train(precision="fp32", **kwargs)[0], exact=True)


def test_a_stage_told_of_another_stages_overflow_skips_and_backs_off_as_if_it_were_its_own():
    def stage(grad: float):
        layer = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        scaler = grad_scaler("fp16", torch.device("cpu"))
        scaler.scale(torch.zeros(()))
        for param in layer.parameters():
            param.grad = torch.full_like(param, grad)
        return layer, optimizer, scaler

    own, told = stage(float("inf")), stage(1.0)
    grads = [p.grad for p in told[0].parameters()]
    assert overflowed([p.grad for p in own[0].parameters()]) and not overflowed(grads)
    mark_overflow(grads)
    for layer, optimizer, scaler in (own, told):
        before = {k: v.clone() for k, v in layer.state_dict().items()}
        scaler.step(optimizer)
        scaler.update()
        assert_same_weights(layer.state_dict(), before, exact=True)  # the step was skipped
        assert scaler.get_scale() == 32768.0  # and the scale backed off from 65536
