"""On a real cluster, requests it can never meet fail at once with one line, instead of Ray
retrying forever; an autoscaling cluster is waited for, up to --resource-timeout."""

from __future__ import annotations

import pytest

from ray_jobs import ddp
from ray_jobs.core.config import TrainConfig, WorkerScaling
from ray_jobs.driver import resources as preflight
from ray_jobs.driver.prepare import prepare
from ray_jobs.driver.resources import ResourceError

TWO_WORKERS = preflight.Request("--num-workers", 2, {"CPU": "--cpus-per-worker", "GPU": "--gpus-per-worker"})


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        (
            WorkerScaling(num_workers=2, use_gpu=True),
            r"--num-workers 2 asks for 2 GPU in all; the cluster has 0 GPU .*: "
            r"add nodes that have it or drop --use-gpu",
        ),
        (
            WorkerScaling(num_workers=8),
            r"--num-workers 8 asks for 8 CPU in all; the cluster has 4 CPU .*: "
            r"lower --cpus-per-worker \(0.5 fits\) or lower --num-workers \(4 fit\) or add nodes",
        ),
        (WorkerScaling(num_workers=1, cpus_per_worker=6), r"asks for 6 CPU in all; the cluster has 4 CPU"),
        (
            WorkerScaling(num_workers=2, placement_strategy="STRICT_SPREAD"),
            r"STRICT_SPREAD needs 2 nodes; the cluster has 1: use --placement-strategy SPREAD or add nodes",
        ),
    ],
)
@pytest.mark.ray
def test_impossible_requests_fail_before_fit(ray_cluster, regression_data, tmp_path, scaling, message):
    cfg = TrainConfig(data=regression_data, batch_size=16, storage_path=str(tmp_path), name="never")
    with pytest.raises(ResourceError, match=message):
        ddp.run(prepare(cfg, "ddp"), scaling)


@pytest.mark.ray
def test_autoscaling_cluster_waits_then_fails_with_the_same_message(ray_cluster, monkeypatch, capsys):
    # Pretend the autoscaler could add GPU nodes: the request is then worth waiting for.
    monkeypatch.setattr(preflight, "autoscaling_limits", lambda: {"CPU": 64.0, "GPU": 8.0})
    monkeypatch.setattr(preflight, "PROGRESS_EVERY_S", 0.0)
    with pytest.raises(ResourceError, match=r"asks for 2 GPU in all; the cluster has 0 GPU .*waited 2 s"):
        preflight.wait_for_bundles([{"CPU": 1.0, "GPU": 1.0}] * 2, "PACK", TWO_WORKERS, timeout_s=2)
    assert "[raypar] waiting for the autoscaler" in capsys.readouterr().out


@pytest.mark.ray
def test_autoscaling_cluster_that_can_never_fit_fails_at_once(ray_cluster, monkeypatch):
    monkeypatch.setattr(preflight, "autoscaling_limits", lambda: {"CPU": 64.0, "GPU": 1.0})
    with pytest.raises(ResourceError, match="asks for 2 GPU"):
        preflight.wait_for_bundles([{"CPU": 1.0, "GPU": 1.0}] * 2, "PACK", TWO_WORKERS, timeout_s=3600)
