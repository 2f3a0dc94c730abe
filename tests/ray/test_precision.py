"""--precision on Ray: bf16 and fp16 strategies against a single-process reference in the same
precision, and fp16's scale through a resume."""

from __future__ import annotations

import json

import pytest
import torch

from ray_jobs.core.checkpoint import read_checkpoint
from ray_jobs.core.config import TrainConfig
from ray_jobs.pipeline import trainer as pipeline
from tests.helpers import load_weights, reference_for, run_strategy, with_

# bf16 runs against the bf16 reference: each worker's (or micro-batch's) weight gradient comes
# out of a bf16 matmul over its own rows, rounded to bf16's 8-bit mantissa before the float32
# all-reduce (or accumulation), where the reference rounds the whole batch's sum once: ~0.4% per
# gradient, compounding over 18 momentum steps. Measured (mlp 12x3): max |diff| 4.4e-4 with 2 DDP
# workers, 5.4e-4 for the pipeline S=2 M=4, while bf16 itself moves these weights 8e-3 from float32,
# so the tolerance still tells a bf16 run from a float32 one (checked below).
BF16_ATOL = 2e-3


@pytest.fixture
def bf16(regression_data, tmp_path) -> TrainConfig:
    return TrainConfig(
        model="mlp",
        hidden=12,
        depth=3,
        data=regression_data,
        epochs=3,
        batch_size=16,
        seed=7,
        momentum=0.9,
        precision="bf16",
        storage_path=str(tmp_path),
        name="run",
    )


def _assert_bf16_reference(summary, cfg: TrainConfig) -> None:
    got = load_weights(summary.run_dir)
    expected, losses = reference_for(cfg)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=BF16_ATOL, msg=key)  # BF16_ATOL's reason
    assert summary.losses == pytest.approx(losses, rel=1e-2)  # the same bf16 rounding, in the losses
    fp32 = reference_for(with_(cfg, precision="fp32"))[0]
    assert max((got[k] - fp32[k]).abs().max().item() for k in fp32) > 2 * BF16_ATOL  # it did run in bf16
    assert json.loads(open(f"{summary.run_dir}/summary.json").read())["precision"] == "bf16"


@pytest.mark.ray
def test_bf16_ddp_two_workers_matches_the_bf16_reference(ray_cluster, bf16):
    _assert_bf16_reference(run_strategy("ddp", bf16, num_workers=2), bf16)


@pytest.mark.ray
def test_bf16_pipeline_matches_the_bf16_reference(ray_cluster, bf16):
    scaling = pipeline.PipelineScaling(num_stages=2, num_microbatches=4)  # p2p: activations as float32
    _assert_bf16_reference(run_strategy("pipeline", bf16, scaling=scaling), bf16)


@pytest.mark.ray
def test_fp16_pipeline_matches_the_fp16_reference_and_resumes_with_its_scale(ray_cluster, bf16):
    # fp16 autocast and GradScaler run on CPU: the pipeline's scaler path, entered below the
    # flag's GPU check (what a user reaches with --use-gpu). Tolerance: fp16's 11-bit mantissa
    # rounds each micro-batch's gradient as bf16 rounds it (BF16_ATOL's reason), 8x finer;
    # no step of this run overflows (65536 kept), as in the reference.
    from ray_jobs.driver.prepare import prepare

    cfg = with_(bf16, precision="fp16", epochs=2)
    scaling = pipeline.PipelineScaling(num_stages=2, num_microbatches=4)
    pipeline._attempts(prepare(cfg, "pipeline"), scaling, None)
    resumed = pipeline._attempts(prepare(with_(cfg, epochs=3), "pipeline"), scaling, None)
    assert resumed.resumed_from_epoch == 2
    got, (expected, _) = load_weights(resumed.run_dir), reference_for(with_(cfg, epochs=3))
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=BF16_ATOL / 8, msg=key)
    assert read_checkpoint(f"{resumed.run_dir}/checkpoint_epoch_000003").scaler["scale"] == 65536.0


@pytest.mark.ray
def test_fp16_ddp_matches_the_fp16_reference_and_checkpoints_its_scale(ray_cluster, bf16):
    # As the fp16 pipeline test: the flag's GPU check passed by, to run fp16 and its scaler on CPU
    # (resuming with the scale is the pipeline test's; the loop restores it with the same call).
    from ray_jobs.core.config import WorkerScaling
    from ray_jobs.data_parallel.trainer import _fit
    from ray_jobs.data_parallel.wrap import Replicas, wrap_ddp
    from ray_jobs.driver.prepare import prepare
    from ray_jobs.testing.faults import NO_FAULTS

    cfg = with_(bf16, precision="fp16")
    summary = _fit(prepare(cfg, "ddp"), WorkerScaling(num_workers=2), Replicas(wrap_ddp), None, NO_FAULTS)
    got, (expected, _) = load_weights(summary.run_dir), reference_for(cfg)
    for key in expected:  # tolerance: as the fp16 pipeline's
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=BF16_ATOL / 8, msg=key)
    assert read_checkpoint(f"{summary.run_dir}/checkpoint_epoch_000003").scaler["scale"] == 65536.0
