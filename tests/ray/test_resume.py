"""Exact resume: a run that restarts from a checkpoint ends with the uninterrupted run's weights."""

from __future__ import annotations

import pytest

from ray_jobs.core.config import TrainConfig
from ray_jobs.errors import TrainingFailed
from tests.helpers import (
    assert_same_weights,
    assert_trains_the_reference,
    load_weights,
    reference_for,
    run_strategy,
    with_,
)

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


# ddp and fsdp: tests/ray/test_interrupts.py, resumed after a SIGKILLed worker.
@pytest.mark.parametrize("strategy", ["pipeline"])
def test_a_dropout_model_resumes_to_the_uninterrupted_runs_weights(ray_cluster, cfg, tmp_path, strategy):
    """Every stage's RNG state is in the checkpoint: the masks after a resume are the ones the
    uninterrupted run drew; and the LR schedule goes on from the checkpoint's step, not from a new
    warmup."""
    from ray_jobs.pipeline.scaling import PipelineScaling

    # 6 steps an epoch: the resume after epoch 1 lands mid-warmup.
    dropout = with_(cfg, model="mlp", depth=3, dropout=0.3, lr_schedule="cosine", warmup_steps=9, min_lr=0.005)
    options = {"scaling": PipelineScaling(num_stages=2)} if strategy == "pipeline" else {"num_workers": 2}
    uninterrupted = run_strategy(strategy, with_(dropout, name="whole"), **options)
    resumed = run_strategy(strategy, with_(dropout, name="cut", max_failures=1), crash_at_epoch=1, **options)
    assert resumed.resumed_from_epoch == 1  # fsdp: from epoch 1's shards, checkpoint.pt holding no weights
    # Same world size, same batches, same masks, same reduction order: bit for bit.
    assert_same_weights(load_weights(resumed.run_dir), load_weights(uninterrupted.run_dir), exact=True)
    assert resumed.losses == uninterrupted.losses


def test_a_rerun_continues_from_the_most_work_done_and_rewrites_the_outputs_a_shorter_run_left(
    ray_cluster, cfg, tmp_path
):
    """Re-running a name continues it to more epochs, from its newest checkpoint:
    - object stores keep whole seconds, and a copied run directory has new times: resume and
      model.pt must still come from the checkpoint with the most work done;
    - the run trained 2 epochs (its outputs written), then was raised to 3 and stopped once epoch
      3's checkpoint was written, before its outputs: a re-run with --epochs 3 must not call the
      2-epoch outputs complete, and ends with the 3-epoch checkpoint's model and summary."""
    import json
    import os
    import shutil

    run_dir = tmp_path / "run"
    first = run_strategy("dp", with_(cfg, epochs=2, num_checkpoints_to_keep=3))
    stale = {name: (run_dir / name).read_bytes() for name in ("model.pt", "summary.json")}
    expected_weights, _ = reference_for(cfg)

    copy = tmp_path / "copied"
    shutil.copytree(first.run_dir, copy, copy_function=shutil.copy)
    (copy / "model.pt").unlink()
    for root, dirs, files in os.walk(copy):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (1_000_000_000, 1_000_000_000))
    os.utime(next(copy.glob("checkpoint_*1/checkpoint.pt")))  # the older checkpoint now looks newest
    second = run_strategy("dp", with_(cfg, name="copied"))
    assert second.resumed_from_epoch == 2 and second.epochs_completed == 3
    assert_same_weights(load_weights(second.run_dir), expected_weights)

    run_strategy("dp", cfg)
    for name, content in stale.items():
        (run_dir / name).write_bytes(content)
    summary = run_strategy("dp", cfg)
    assert summary.epochs_completed == 3 and summary.resumed_from_epoch == 3
    assert json.loads((run_dir / "summary.json").read_text())["epochs_completed"] == 3
    assert_same_weights(load_weights(str(run_dir)), expected_weights)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_worker_killed_in_a_background_upload_resumes_from_the_last_whole_checkpoint(
    ray_cluster, cfg, tmp_path, strategy
):
    """--checkpoint-mode async: world rank 0 dies while its upload of epoch 2's checkpoint runs in
    the background (training went on meanwhile). The restart resumes from epoch 1's checkpoint,
    the newest whole one (epoch 2's never reached storage; fsdp's other rank's shards may have),
    and ends on the single-process weights; the loop was held only for each copy."""
    from ray_jobs.core.checkpoint import checkpoint_name

    background = with_(cfg, checkpoint_mode="async", max_failures=1)
    summary = run_strategy(strategy, background, num_workers=2, crash_in_upload=checkpoint_name(2))
    assert summary.resumed_from_epoch == 1
    assert_trains_the_reference(summary, background)
    assert summary.extra["checkpoint_stall_s"]  # the restart's epoch-2 checkpoint, before the final
