"""Numerical faults stop the run with the epoch and step named, and keep the last good checkpoint."""

from __future__ import annotations

import json

import pytest

from ray_jobs.core.config import TrainConfig
from ray_jobs.errors import TrainingFailed
from ray_jobs.pipeline.scaling import PipelineScaling
from tests.helpers import run_strategy

pytestmark = pytest.mark.ray


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("ddp", {"num_workers": 2}),
        ("pipeline", {"scaling": PipelineScaling(num_stages=2, num_microbatches=2)}),
    ],
)
def test_diverging_loss_stops_and_keeps_the_last_good_checkpoint(
    ray_cluster, regression_data, tmp_path, strategy, options
):
    # lr 3.0 on this data: epoch 1's mean loss is ~6e15 but finite, epoch 2 reaches inf/NaN.
    cfg = TrainConfig(
        model="seed-mlp",
        hidden=8,
        data=regression_data,
        epochs=4,
        batch_size=16,
        seed=7,
        lr=3.0,
        storage_path=str(tmp_path),
        name="nan",
    )
    with pytest.raises(TrainingFailed, match=r"loss became (nan|inf) at epoch 2, step \d+; lower --lr"):
        run_strategy(strategy, cfg, **options)
    run_dir = tmp_path / "nan"
    assert not (run_dir / "model.pt").exists()
    assert len(list(run_dir.glob("checkpoint_*/checkpoint.pt"))) == 1  # epoch 1's, the last good one
    assert "at epoch 2" in json.loads((run_dir / "failure.json").read_text())["error"]
