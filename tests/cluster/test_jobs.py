"""``ray job submit`` end to end on a local multi-node cluster (head + 2 worker nodes).

Its ports are free ones picked at run time, so it never meets the shared cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from ray.job_submission import JobStatus, JobSubmissionClient

from cluster import local
from ray_jobs.core.config import TrainConfig
from tests.helpers import REPO, assert_same_weights, load_weights, reference_for, running_cluster

pytestmark = pytest.mark.cluster

JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cluster_state(tmp_path_factory):
    """Two worker nodes of 2 logical CPUs each: room for PACK (both workers on one node)."""
    state_dir = str(tmp_path_factory.mktemp("jobs-cluster"))
    with running_cluster(state_dir, "--num-nodes", "2", "--cpus-per-node", "2"):
        yield local.load_state(Path(state_dir))


@pytest.fixture(scope="module")
def client(cluster_state) -> JobSubmissionClient:
    token = Path(cluster_state["token_path"]).read_text().strip()
    return JobSubmissionClient(cluster_state["dashboard_url"], headers={"Authorization": f"Bearer {token}"})


def submit(client: JobSubmissionClient, *args: str) -> str:
    return client.submit_job(
        entrypoint=" ".join(["python", "-m", *args]),
        runtime_env={"working_dir": str(REPO), "excludes": local.UPLOAD_EXCLUDES},
    )


def wait_for(client: JobSubmissionClient, job_id: str, statuses: set) -> JobStatus:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        status = client.get_job_status(job_id)
        if status in statuses:
            return status
        time.sleep(1)
    client.stop_job(job_id)
    pytest.fail(f"job {job_id} not in {statuses} after {JOB_TIMEOUT_S} s; logs:\n{client.get_job_logs(job_id)}")


def run_job(client: JobSubmissionClient, *args: str) -> str:
    job_id = submit(client, *args)
    status = wait_for(client, job_id, {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED})
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs
    return logs


def flags(cfg: TrainConfig) -> list[str]:
    return [
        "--model",
        cfg.model,
        "--data",
        cfg.data,
        "--hidden",
        str(cfg.hidden),
        "--epochs",
        str(cfg.epochs),
        "--batch-size",
        str(cfg.batch_size),
        "--seed",
        str(cfg.seed),
        "--storage-path",
        cfg.storage_path,
        "--name",
        cfg.name,
    ]


def summary(cfg: TrainConfig) -> dict:
    return json.loads((Path(cfg.storage_path) / cfg.name / "summary.json").read_text())


def test_job_without_the_token_is_refused(cluster_state):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    result = subprocess.run(
        [*local.ray_command(), "job", "submit", "--address", cluster_state["dashboard_url"], "--", "echo", "hi"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "401" in result.stdout + result.stderr or "nauthorized" in result.stdout + result.stderr


def test_job_stop_ends_the_workers_and_the_cluster_stays_usable(client, cluster_state, tmp_path):
    """The job places its workers with the default PACK: both on one node while it trains."""
    job_id = submit(
        client,
        "ray_jobs.ddp",
        "--num-workers",
        "2",
        "--epochs",
        "100000",
        "--storage-path",
        str(tmp_path),
        "--name",
        "long",
    )
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while "[raypar] epoch 1/" not in client.get_job_logs(job_id):
        assert time.monotonic() < deadline, client.get_job_logs(job_id)
        assert client.get_job_status(job_id) == JobStatus.RUNNING or not client.get_job_status(job_id).is_terminal()
        time.sleep(1)
    workers = [
        actor
        for actor in local.fetch_nodes(cluster_state, "actors")
        if actor["class_name"] == "RayTrainWorker" and actor["state"] == "ALIVE"
    ]
    assert len(workers) == 2 and len({actor["node_id"] for actor in workers}) == 1, workers
    client.stop_job(job_id)
    assert wait_for(client, job_id, {JobStatus.STOPPED, JobStatus.FAILED, JobStatus.SUCCEEDED}) == JobStatus.STOPPED
    # The next tests' jobs need every CPU of the worker nodes back: they are the usability check.


def test_ddp_job_strict_spread_and_reference_weights(client, regression_data, tmp_path):
    """PACK's placement is checked while the job above runs."""
    cfg = TrainConfig(
        model="seed-mlp",
        hidden=8,
        data=regression_data,
        epochs=2,
        batch_size=16,
        seed=7,
        storage_path=str(tmp_path),
        name="strict",
    )
    logs = run_job(client, "ray_jobs.ddp", "--num-workers", "2", "--placement-strategy", "STRICT_SPREAD", *flags(cfg))
    assert logs.count("[raypar] epoch 1/2") == 1  # rank 0 only, printed once
    record = summary(cfg)
    assert len(set(record["worker_nodes"])) == 2
    assert sorted(record["worker_node_ranks"]) == [0, 1]
    assert_same_weights(load_weights(str(tmp_path / cfg.name)), reference_for(cfg)[0])


def test_a_pipeline_grid_job_keeps_each_stages_copies_on_one_node(client, regression_data, tmp_path):
    """--data-parallel 2 x 2 stages with the default PACK on two nodes of 2 CPUs: a stage's two
    copies (their gradient all-reduce) share a node, the stages' hops cross nodes over p2p, and
    the run ends on the single-process weights."""
    cfg = TrainConfig(
        model="seed-split",
        hidden=8,
        data=regression_data,
        epochs=2,
        batch_size=16,
        seed=3,
        storage_path=str(tmp_path),
        name="pipe",
    )
    run_job(
        client,
        "ray_jobs.pipeline",
        "--num-stages",
        "2",
        "--data-parallel",
        "2",
        "--num-microbatches",
        "2",
        *flags(cfg),
    )
    record = summary(cfg)
    nodes = record["stage_nodes"]  # rank order: replica 0's stages 0 and 1, then replica 1's
    assert nodes[0] == nodes[2] and nodes[1] == nodes[3] and nodes[0] != nodes[1], nodes
    assert record["transport"] == "p2p_gloo"  # auto works across nodes
    assert_same_weights(load_weights(str(tmp_path / cfg.name)), reference_for(cfg)[0])
