"""The local multi-node cluster: ``python -m cluster.local up|status|down`` against real ``ray start`` nodes.

Ports are free ones picked at run time, so this cluster never meets the shared
``ray.init`` cluster other tests start in the same pytest process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cluster.local import free_port

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
GCS_PORT, DASHBOARD_PORT = free_port(), free_port()
PORTS = ["--port", str(GCS_PORT), "--dashboard-port", str(DASHBOARD_PORT)]
JOBS_API = f"http://127.0.0.1:{DASHBOARD_PORT}/api/jobs/"


def cluster_cli(*argv: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # nothing from the shared cluster
    return subprocess.run(
        [sys.executable, "-m", "cluster.local", *argv], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )


@pytest.fixture
def local_cluster(tmp_path):
    """A head and two 1-CPU worker nodes, always stopped afterwards, even when the test fails."""
    state_dir = str(tmp_path / "state")
    try:
        started = cluster_cli("up", "--state-dir", state_dir, "--num-nodes", "2", "--cpus-per-node", "1", *PORTS)
        assert started.returncode == 0, started.stdout + started.stderr
        yield state_dir, started.stdout
    finally:
        stopped = cluster_cli("down", "--state-dir", state_dir, "--timeout", "15")
        assert stopped.returncode == 0, stopped.stderr


def http_status(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_status_auth_down(local_cluster):
    state_dir, up_output = local_cluster
    state = json.loads((Path(state_dir) / "cluster.json").read_text())
    token = Path(state["token_path"]).read_text().strip()
    assert f"ray job submit --address http://127.0.0.1:{DASHBOARD_PORT}" in up_output and state["token_path"] in up_output

    shown = cluster_cli("status", "--state-dir", state_dir)
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines() if line.startswith("127.")]
    assert len(rows) == 3 and all("ALIVE" in row for row in rows), shown.stdout
    assert len({row[0] for row in rows}) == 3  # distinct node IPs, so node ranks differ

    assert http_status(JOBS_API) == 401
    assert http_status(JOBS_API, "not-the-token") == 403
    assert http_status(JOBS_API, token) == 200

    again = cluster_cli("up", "--state-dir", state_dir, *PORTS)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [again.stderr.strip()]
    assert "already running" in again.stderr

    stopped = cluster_cli("down", "--state-dir", state_dir, "--timeout", "15")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.count("stopped node") == 3
    assert not [node["ip"] for node in state["nodes"] if group_exists(node["pgid"])]
    assert not (Path(state_dir) / "cluster.json").exists()
