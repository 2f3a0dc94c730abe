"""Real signals to real processes: Ctrl-C / SIGTERM to a job, SIGKILL to a Ray Train worker."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
from ray.util.state import list_actors

from ray_jobs.core.checkpoint import latest_checkpoint
from ray_jobs.core.config import TrainConfig
from tests.helpers import assert_same_weights, load_weights, run_strategy

pytestmark = pytest.mark.ray

RUN_ACTORS = ("TrainController", "RayTrainWorker", "StageWorker")
WAIT_S = 120  # generous bounds: these guard against hangs, they do not measure speed


class Job:
    """A ``python -m ray_jobs.<module>`` process joined to the shared cluster, its output collected."""

    def __init__(self, module: str, *args: str) -> None:
        env = {**os.environ, "RAY_AUTH_MODE": "token"}  # the shared cluster's token is ~/.ray/auth_token
        address = ray.get_runtime_context().gcs_address
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, "--address", address, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.2)

    def stop(self, signum: int) -> int:
        self.process.send_signal(signum)
        try:
            return self.process.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            pytest.fail("the job did not stop:\n" + "".join(self.lines))


def alive_run_actors(dashboard_url: str) -> list[str]:
    actors = list_actors(address=dashboard_url, filters=[("state", "=", "ALIVE")])
    return [a.class_name for a in actors if a.class_name in RUN_ACTORS]


def wait_until_no_run_actors(dashboard_url: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while alive_run_actors(dashboard_url):
        assert time.monotonic() < deadline, f"still alive: {alive_run_actors(dashboard_url)}"
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("module", "args", "signum"),
    [
        ("ray_jobs.ddp", ["--num-workers", "2"], signal.SIGINT),
        ("ray_jobs.pipeline", ["--num-stages", "2", "--model", "mlp"], signal.SIGTERM),
    ],
)
def test_interrupt_stops_the_job_keeps_the_checkpoint_and_leaves_no_actor(ray_cluster, tmp_path, module, args, signum):
    job = Job(module, *args, "--epochs", "100000", "--storage-path", str(tmp_path), "--name", "run")
    job.wait_for("[raypar] epoch 2/")
    assert job.stop(signum) == 130, "".join(job.lines)
    assert "interrupted: stopping the run's workers" in "".join(job.lines)
    assert "Traceback" not in "".join(job.lines)
    wait_until_no_run_actors(ray_cluster.dashboard_url)
    resume_from = latest_checkpoint(str(tmp_path / "run"))  # what a re-run with the same --name picks
    assert resume_from is not None and resume_from.epochs_completed >= 1
    assert not (tmp_path / "run" / "model.pt").exists()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_sigkilled_train_worker_resumes_to_the_uninterrupted_runs_weights(
    ray_cluster, regression_data, tmp_path, strategy
):
    """A real process death mid-run, then a resume from the newest checkpoint: momentum (optimizer
    state; fsdp's in the shards), every rank's RNG state (dropout masks) and the LR schedule's step
    all come back, so the run ends bit for bit on the uninterrupted run's weights (the same world
    size: the same sums in the same order). The pipeline's stages: tests/ray/test_resume.py."""
    cfg = TrainConfig(
        model="mlp", depth=3, hidden=8, dropout=0.3, data=regression_data, epochs=6, batch_size=16, seed=13,
        momentum=0.9, lr_schedule="cosine", warmup_steps=9, min_lr=0.005, storage_path=str(tmp_path), name="whole",
    )  # fmt: skip
    uninterrupted = run_strategy(strategy, cfg, num_workers=2)
    cfg = dataclasses.replace(cfg, name="killed", max_failures=1)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(summary=run_strategy(strategy, cfg, num_workers=2)))
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while latest_checkpoint(str(tmp_path / "killed")) is None:
        assert time.monotonic() < deadline and thread.is_alive(), "no checkpoint appeared"
        time.sleep(0.1)
    workers = list_actors(
        address=ray_cluster.dashboard_url, filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")]
    )
    os.kill(workers[0].pid, signal.SIGKILL)  # a real process death, mid-run
    thread.join(timeout=WAIT_S * 2)
    summary = outcome["summary"]
    assert summary.resumed_from_epoch is not None and summary.epochs_completed == 6
    assert_same_weights(load_weights(summary.run_dir), load_weights(uninterrupted.run_dir), exact=True)
    assert summary.losses == uninterrupted.losses
