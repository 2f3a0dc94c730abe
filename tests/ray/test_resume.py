"""Exact resume: a run that restarts from a checkpoint ends with the uninterrupted run's weights."""

from __future__ import annotations

import pytest

from ray_jobs.core.config import TrainConfig
from ray_jobs.errors import TrainingFailed
from tests.helpers import assert_same_weights, load_weights, reference_for, run_strategy, with_

pytestmark = pytest.mark.ray


@pytest.fixture
def cfg(regression_data, tmp_path) -> TrainConfig:
    # Momentum makes the optimizer state matter: a resume that dropped it would diverge.
    return TrainConfig(
        model="seed-mlp",
        hidden=8,
        data=regression_data,
        epochs=3,
        batch_size=16,
        seed=11,
        momentum=0.9,
        storage_path=str(tmp_path),
        name="run",
    )


def test_worker_death_without_retries_fails_instead_of_hanging(ray_cluster, cfg, tmp_path):
    with pytest.raises(TrainingFailed):
        run_strategy("ddp", cfg, num_workers=2, crash_at_epoch=1)
    assert not (tmp_path / "run" / "model.pt").exists()  # no final result from a failed run


@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_a_dropout_model_resumes_to_the_uninterrupted_runs_weights(ray_cluster, cfg, tmp_path, strategy):
    """Every rank's (stage's) RNG state is in the checkpoint: the masks after a resume are the
    ones the uninterrupted run drew."""
    from ray_jobs.pipeline.scaling import PipelineScaling

    dropout = with_(cfg, model="mlp", depth=3, dropout=0.3)
    options = {"num_workers": 2} if strategy == "ddp" else {"scaling": PipelineScaling(num_stages=2)}
    uninterrupted = run_strategy(strategy, with_(dropout, name="whole"), **options)
    resumed = run_strategy(strategy, with_(dropout, name="cut", max_failures=1), crash_at_epoch=1, **options)
    assert resumed.resumed_from_epoch == 1
    # Same world size, same batches, same masks, same reduction order: bit for bit.
    assert_same_weights(load_weights(resumed.run_dir), load_weights(uninterrupted.run_dir), exact=True)
    assert resumed.losses == uninterrupted.losses


def test_a_rerun_continues_from_the_most_work_done_when_file_times_say_nothing(ray_cluster, cfg, tmp_path):
    """Re-running a name continues it to more epochs. Object stores keep whole seconds, and a
    copied run directory has new times: resume and model.pt must still come from the newest
    checkpoint."""
    import os
    import shutil

    first = run_strategy("dp", with_(cfg, epochs=2, num_checkpoints_to_keep=3))
    copy = tmp_path / "copied"
    shutil.copytree(first.run_dir, copy, copy_function=shutil.copy)
    (copy / "model.pt").unlink()
    for root, dirs, files in os.walk(copy):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (1_000_000_000, 1_000_000_000))
    os.utime(next(copy.glob("checkpoint_*1/checkpoint.pt")))  # the older checkpoint now looks newest
    second = run_strategy("dp", with_(cfg, name="copied"))
    assert second.resumed_from_epoch == 2 and second.epochs_completed == 3
    expected_weights, _ = reference_for(cfg)
    assert_same_weights(load_weights(second.run_dir), expected_weights)
