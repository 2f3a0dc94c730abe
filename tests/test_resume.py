"""Exact resume: a run that restarts from a checkpoint ends with the uninterrupted run's weights."""
from __future__ import annotations

import pytest

from ray_jobs.config import TrainConfig
from ray_jobs.train_workers import TrainingFailed
from tests.helpers import assert_same_weights, load_weights, reference_for, run_strategy, with_

pytestmark = pytest.mark.ray


@pytest.fixture
def cfg(regression_data, tmp_path) -> TrainConfig:
    # Momentum makes the optimizer state matter: a resume that dropped it would diverge.
    return TrainConfig(
        model="seed-mlp", hidden=8, data=regression_data, epochs=3, batch_size=16, seed=11,
        momentum=0.9, storage_path=str(tmp_path), name="run",
    )


def test_worker_death_resumes_from_latest_checkpoint(ray_cluster, cfg):
    summary = run_strategy("ddp", with_(cfg, max_failures=1), num_workers=2, crash_at_epoch=1)
    assert summary.resumed_from_epoch == 1
    assert summary.epochs_completed == 3 and len(summary.losses) == 3
    expected_weights, expected_losses = reference_for(cfg)
    assert_same_weights(load_weights(summary.run_dir), expected_weights)
    assert summary.losses == pytest.approx(expected_losses, rel=1e-5)  # epoch 1's loss came from the checkpoint


def test_worker_death_without_retries_fails_instead_of_hanging(ray_cluster, cfg, tmp_path):
    with pytest.raises(TrainingFailed):
        run_strategy("ddp", cfg, num_workers=2, crash_at_epoch=1)
    assert not (tmp_path / "run" / "model.pt").exists()  # no final result from a failed run


def test_rerun_with_same_name_continues_to_more_epochs(ray_cluster, cfg):
    first = run_strategy("dp", with_(cfg, epochs=2))
    assert first.resumed_from_epoch is None
    second = run_strategy("dp", cfg)
    assert second.resumed_from_epoch == 2 and second.epochs_completed == 3
    expected_weights, _ = reference_for(cfg)
    assert_same_weights(load_weights(second.run_dir), expected_weights)
