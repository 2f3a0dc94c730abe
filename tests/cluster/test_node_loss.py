"""Losing a node for real: a worker node of a local multi-node cluster is preempted mid-run (every
process of it SIGKILLed at once, ``python -m cluster.local preempt``), and the run still ends with
the single-process reference's weights: a pipeline stage is replaced; an elastic ddp or fsdp run
goes on at the smaller worker count, and ddp also grows back once the node returns (``python -m
cluster.local rejoin``).

The cluster's ports are free ones picked at run time, so it never meets the shared cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from cluster import local
from ray_jobs.core.config import TrainConfig
from tests.helpers import REPO, assert_same_weights, cluster_cli, load_weights, reference_for, running_cluster

pytestmark = pytest.mark.cluster

WAIT_S = 300  # a bound against hangs: Ray marks a lost node dead ~15 s after it goes
# The elastic policy's coordinator looks at the cluster every 20 s, then the group restarts.
GROW_WAIT_S = 120


@pytest.fixture(scope="module")
def cluster_state(tmp_path_factory):
    """Three worker nodes of one CPU each, so a lost node's share is visible in the worker count."""
    state_dir = str(tmp_path_factory.mktemp("node-loss-cluster"))
    with running_cluster(state_dir, "--num-nodes", "3", "--cpus-per-node", "1"):
        yield {**local.load_state(Path(state_dir)), "state_dir": state_dir}


def alive_worker_nodes(state: dict) -> list[str]:
    """The worker nodes whose processes run, once Ray's view agrees (a node lost just before is
    marked dead ~15 s after it went)."""
    nodes = local.load_state(Path(state["state_dir"]))["nodes"]  # as recorded now: a rejoin records new processes
    running = sorted(node["ip"] for node in nodes if node["ip"] != local.HEAD_NODE_IP and local.group_alive(node))
    deadline = time.monotonic() + WAIT_S
    while (
        seen := sorted(
            n["node_ip"] for n in local.fetch_nodes(state) if n["state"] == "ALIVE" and not n["is_head_node"]
        )
    ) != running:
        assert time.monotonic() < deadline, (seen, running)
        time.sleep(0.5)
    return running


def nodes_hosting(state: dict, class_name: str) -> list[str]:
    ips = {n["node_id"]: n["node_ip"] for n in local.fetch_nodes(state)}
    return sorted(
        {
            ips[a["node_id"]]
            for a in local.fetch_nodes(state, "actors")
            if a["class_name"] == class_name and a["state"] == "ALIVE"
        }
    )


def run_losing_a_node(
    state: dict, tmp_path: Path, strategy: str, actor_class: str, flags: list[str], rejoin: bool = False
) -> str:
    """Run ``strategy`` as its own driver; once epoch 1's checkpoint is written and the run waits
    (the tests' hold), preempt a node hosting one of its ``actor_class`` actors. With ``rejoin``,
    once the run goes on without it and waits again at epoch 2, start that node again and wait
    for the run to grow back onto it. Returns the output."""
    lost, back = tmp_path / "lost", tmp_path / "back"
    faults = json.dumps({"holds": [(1, str(lost))] + ([(2, str(back))] if rejoin else [])})
    env = {k: v for k, v in local.ray_env(state).items() if k != "RAY_API_SERVER_ADDRESS"}
    # Ray Train's elastic policy sees a lost node only at its coordinator's next look (every
    # 20 s); each start it tries on the old count meanwhile fails after this bound (default 60 s).
    env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "15"
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.fault_driver", strategy, faults, "--address", state["address"], *flags],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    try:
        wait_for(lambda: Path(f"{lost}.waiting").exists(), process, lines)
        victim = nodes_hosting(state, actor_class)[-1]
        preempted = cluster_cli("preempt", "--state-dir", state["state_dir"], "--node", victim)
        assert preempted.returncode == 0, preempted.stderr
        lost.touch()
        if rejoin:
            wait_for(lambda: Path(f"{back}.waiting").exists(), process, lines)
            rejoined = cluster_cli("rejoin", "--state-dir", state["state_dir"], "--node", victim)
            assert rejoined.returncode == 0, rejoined.stderr
            # Growing restarts the workers, so the held ones never go on; a run that does not
            # grow is let go on (and fails the test's asserts) rather than held until timeout.
            with contextlib.suppress(AssertionError):
                wait_for(lambda: "checkpoint after epoch 2" in "".join(lines), process, lines, timeout=GROW_WAIT_S)
            back.touch()
        assert process.wait(timeout=WAIT_S) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
    time.sleep(0.5)  # the reader thread's last lines
    return "".join(lines)


def wait_for(done: Callable[[], bool], process: subprocess.Popen, lines: list[str], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert process.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)


def config(data: str, tmp_path: Path, model: str) -> tuple[TrainConfig, list[str]]:
    cfg = TrainConfig(
        model=model,
        hidden=8,
        data=data,
        epochs=3,
        batch_size=16,
        seed=7,
        storage_path=str(tmp_path / "runs"),
        name="run",
    )
    flags = [
        "--model",
        cfg.model,
        "--hidden",
        "8",
        "--data",
        cfg.data,
        "--epochs",
        "3",
        "--batch-size",
        "16",
        "--seed",
        "7",
        "--storage-path",
        cfg.storage_path,
        "--name",
        cfg.name,
        "--max-failures",
        "3",
    ]
    return cfg, flags


def summary_of(cfg: TrainConfig) -> dict:
    return json.loads((Path(cfg.storage_path) / cfg.name / "summary.json").read_text())


def test_pipeline_stage_node_lost_with_room_left_is_replaced(cluster_state, regression_data, tmp_path):
    assert len(alive_worker_nodes(cluster_state)) == 3  # a spare node for the lost stage
    cfg, flags = config(regression_data, tmp_path, "seed-split")
    output = run_losing_a_node(
        cluster_state,
        tmp_path,
        "pipeline",
        "StageWorker",
        [*flags, "--num-stages", "2", "--num-microbatches", "4", "--placement-strategy", "SPREAD"],
    )
    assert "restarting the pipeline from the latest checkpoint" in output
    assert "Unhandled error" not in output  # the other stages' failed calls are taken, not printed by Ray
    record = summary_of(cfg)
    assert record["resumed_from_epoch"] == 1 and record["epochs_completed"] == 3
    assert_same_weights(load_weights(str(Path(cfg.storage_path) / cfg.name)), reference_for(cfg)[0])


def run_elastic_losing_a_node(
    state: dict, data: str, tmp_path: Path, strategy: str, *flags: str, rejoin: bool = False
) -> tuple[int, TrainConfig, str]:
    """An elastic ``strategy`` run of the seed mlp, a worker per live worker node and at least one,
    that loses a node after epoch 1 (``run_losing_a_node``) and goes on at one worker fewer.
    Returns the node count it started on, its config and its output."""
    num_nodes = len(alive_worker_nodes(state))
    cfg, common = config(data, tmp_path, "seed-mlp")
    elastic = [*common, "--num-workers", str(num_nodes), "--min-workers", "1", *flags]
    output = run_losing_a_node(state, tmp_path, strategy, "RayTrainWorker", elastic, rejoin=rejoin)
    assert f"resuming from the checkpoint after epoch 1 on {num_nodes - 1} worker(s)" in output
    return num_nodes, cfg, output


def test_elastic_ddp_shrinks_on_losing_a_node_and_grows_back_with_the_same_weights(
    cluster_state, regression_data, tmp_path
):
    # After the pipeline test: 2 nodes, so 2 -> 1 -> 2 workers; alone: 3 -> 2 -> 3 (16 rows as 6, 5, 5).
    num_nodes, cfg, output = run_elastic_losing_a_node(
        cluster_state, regression_data, tmp_path, "ddp", "--resize-interval", "1", rejoin=True
    )
    assert f"resuming from the checkpoint after epoch 2 on {num_nodes} worker(s)" in output
    record = summary_of(cfg)
    assert record["world_sizes"] == [
        {"num_workers": num_nodes, "epoch": 0, "step": 0},
        {"num_workers": num_nodes - 1, "epoch": 1, "step": 0},
        {"num_workers": num_nodes, "epoch": 2, "step": 0},
    ]
    assert record["world_size"] == num_nodes and record["resumed_from_epoch"] == 2
    assert len(set(record["worker_nodes"])) == num_nodes
    # the global batch is the same on any worker count; all-reduce order is the only difference
    assert_same_weights(load_weights(str(Path(cfg.storage_path) / cfg.name)), reference_for(cfg)[0])


def test_elastic_fsdp_goes_on_at_the_smaller_worker_count_after_losing_a_node(cluster_state, regression_data, tmp_path):
    """The lost worker's shards are gone with it: the run resumes from the last checkpoint's shards,
    resharded onto the workers left."""
    num_nodes, cfg, _ = run_elastic_losing_a_node(cluster_state, regression_data, tmp_path, "fsdp")
    record = summary_of(cfg)
    assert record["strategy"] == "fsdp" and record["world_size"] == num_nodes - 1
    assert record["world_sizes"] == [
        {"num_workers": num_nodes, "epoch": 0, "step": 0},
        {"num_workers": num_nodes - 1, "epoch": 1, "step": 0},
    ]
    # reduce-scatter over fewer workers sums in another order: the tolerance of every strategy's test
    assert_same_weights(load_weights(str(Path(cfg.storage_path) / cfg.name)), reference_for(cfg)[0])
    rejoin_lost_nodes(cluster_state)  # for the test that follows


def rejoin_lost_nodes(state: dict) -> None:
    for node in local.load_state(Path(state["state_dir"]))["nodes"]:
        if node["ip"] != local.HEAD_NODE_IP and not local.group_alive(node):
            rejoined = cluster_cli("rejoin", "--state-dir", state["state_dir"], "--node", node["ip"])
            assert rejoined.returncode == 0, rejoined.stderr


def test_tokenize_on_ray_loses_a_node_and_still_writes_the_single_processes_rows(cluster_state, tmp_path):
    """``tokenize --ray`` as its own driver; a node running one of its Ray Data tasks is preempted
    mid-way. Ray Data runs the lost tasks again on the nodes left, and the shards hold the one
    process's rows in order."""
    import io

    from ray_jobs.bench.cases.tokenize import write_corpus
    from ray_jobs.data import tokenized
    from ray_jobs.data.parquet import read_dataset

    assert len(alive_worker_nodes(cluster_state)) >= 2
    corpus = tmp_path / "corpus"
    write_corpus(str(corpus), 12_000_000)  # 12 files of ~1 MB: bpe takes a second or so a task here
    flags = ["--block-size", "64", "--tokenizer", "bpe", "--vocab-size", "300", "--val-fraction", "0.1"]
    tokenized.tokenize([str(corpus)], str(tmp_path / "one"), 64, kind="bpe", vocab_size=300, val_fraction=0.1,
                       progress_out=io.StringIO())  # fmt: skip
    env = {k: v for k, v in local.ray_env(cluster_state).items() if k != "RAY_API_SERVER_ADDRESS"}
    command = [sys.executable, "-m", "ray_jobs.data", "tokenize", "--ray", "--address", cluster_state["address"]]
    process = subprocess.Popen(
        [*command, "--input", str(corpus), "--output", str(tmp_path / "ray"), *flags],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    try:
        wait_for(lambda: bool(nodes_running_a_task(cluster_state, "MapBatches")), process, lines)
        victim = nodes_running_a_task(cluster_state, "MapBatches")[-1]
        preempted = cluster_cli("preempt", "--state-dir", cluster_state["state_dir"], "--node", victim)
        assert preempted.returncode == 0, preempted.stderr
        assert process.wait(timeout=WAIT_S) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
    for split in ("train", "val"):
        expected = read_dataset(str(tmp_path / "one" / f"{split}.parquet")).features
        assert (read_dataset(str(tmp_path / "ray" / split)).features == expected).all(), split


def nodes_running_a_task(state: dict, name: str) -> list[str]:
    """The worker nodes where a task whose name holds ``name`` runs now."""
    ips = {n["node_id"]: n["node_ip"] for n in local.fetch_nodes(state) if not n["is_head_node"]}
    tasks = local.fetch_nodes(state, "tasks")
    return sorted(
        {ips[t["node_id"]] for t in tasks if name in t["name"] and t["state"] == "RUNNING" and t["node_id"] in ips}
    )
