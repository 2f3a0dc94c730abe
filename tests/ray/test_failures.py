"""Failures on a real run surface as their root cause in one line, and a failed start leaves
nothing behind."""

from __future__ import annotations

import pytest

from ray_jobs.core.config import TrainConfig
from ray_jobs.errors import TrainingFailed
from ray_jobs.pipeline.scaling import PipelineScaling
from tests.helpers import assert_same_weights, load_weights, reference_for, run_strategy, with_


@pytest.fixture
def cfg(regression_data, tmp_path) -> TrainConfig:
    return TrainConfig(
        model="mlp",
        hidden=8,
        depth=3,
        data=regression_data,
        epochs=2,
        batch_size=16,
        seed=3,
        storage_path=str(tmp_path),
        name="run",
    )


def _leftovers(dashboard_url: str) -> tuple[list, list]:
    """This session's Ray's placement groups and stage actors still alive; asked of its own
    dashboard: another pytest worker's Ray runs beside it (`make test`)."""
    from ray.util import placement_group_table
    from ray.util.state import list_actors

    groups = [g for g in placement_group_table().values() if g["state"] not in ("REMOVED",)]
    actors = list_actors(address=dashboard_url, filters=[("class_name", "=", "StageWorker"), ("state", "=", "ALIVE")])
    return groups, actors


@pytest.mark.ray
def test_a_stage_that_dies_while_starting_leaves_nothing_and_is_retried(ray_cluster, cfg):
    with pytest.raises(
        TrainingFailed,
        match=r"stage 1 actor on node \S+ died, while the stages started; "
        r"--max-failures 0 exhausted",
    ):
        run_strategy("pipeline", cfg, scaling=PipelineScaling(num_stages=2), crash_at_start=True)
    groups, actors = _leftovers(ray_cluster.dashboard_url)
    assert groups == [] and actors == []  # in-process callers get no leaked placement group or actor
    summary = run_strategy(
        "pipeline",
        with_(cfg, name="retried", max_failures=1),
        scaling=PipelineScaling(num_stages=2),
        crash_at_start=True,
    )
    assert summary.resumed_from_epoch is None  # the failed start had trained nothing
    assert_same_weights(load_weights(summary.run_dir), reference_for(cfg)[0])


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["p2p", "compiled", "actor_calls"])
def test_a_stages_own_error_is_the_one_line_not_a_retry(ray_cluster, cfg, transport):
    scaling = PipelineScaling(num_stages=2, transport=transport)
    with pytest.raises(TrainingFailed) as failed:
        run_strategy("pipeline", with_(cfg, max_failures=1), scaling=scaling, fail_at_epoch=1)
    # actor_calls used to show "step with micro-batches [...] still waiting for backward" instead.
    assert str(failed.value) == "stage 1: RuntimeError: injected fault"
    assert _leftovers(ray_cluster.dashboard_url)[1] == []


@pytest.mark.ray
def test_a_workers_error_names_its_world_rank(ray_cluster, cfg):
    with pytest.raises(TrainingFailed, match=r"^world rank 1: RuntimeError: injected fault$"):
        run_strategy("ddp", cfg, num_workers=2, fail_at_epoch=1)
