"""The local multi-node cluster: ``python -m cluster.local up|status|down`` against real ``ray start`` nodes.

Ports are free ones picked at run time, so this cluster never meets the shared
``ray.init`` cluster other tests start in the same pytest process.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import cluster_cli, running_cluster

pytestmark = pytest.mark.cluster


@pytest.fixture
def local_cluster(tmp_path):
    """A head and two 1-CPU worker nodes, always stopped afterwards, even when the test fails."""
    state_dir = str(tmp_path / "state")
    with running_cluster(state_dir, "--num-nodes", "2", "--cpus-per-node", "1") as (started, ports):
        yield state_dir, started.stdout, ports


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
    state_dir, up_output, ports = local_cluster
    dashboard_port = ports[ports.index("--dashboard-port") + 1]
    jobs_api = f"http://127.0.0.1:{dashboard_port}/api/jobs/"
    state = json.loads((Path(state_dir) / "cluster.json").read_text())
    token = Path(state["token_path"]).read_text().strip()
    assert (
        f"ray job submit --address http://127.0.0.1:{dashboard_port}" in up_output and state["token_path"] in up_output
    )

    shown = cluster_cli("status", "--state-dir", state_dir)
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines() if line.startswith("127.")]
    assert len(rows) == 3 and all("ALIVE" in row for row in rows), shown.stdout
    assert len({row[0] for row in rows}) == 3  # distinct node IPs, so node ranks differ

    assert http_status(jobs_api) == 401
    assert http_status(jobs_api, "not-the-token") == 403
    assert http_status(jobs_api, token) == 200

    for node, refusal in (
        ("127.0.0.3", "node 127.0.0.3 is running; only a lost node rejoins"),
        ("127.0.0.2", "--node 127.0.0.2 is not a worker node of this cluster"),
    ):
        refused = cluster_cli("rejoin", "--state-dir", state_dir, "--node", node)
        assert refused.returncode == 2 and refused.stderr.startswith(f"error: {refusal}"), refused.stderr
        assert refused.stderr.count("\n") == 1  # one line

    again = cluster_cli("up", "--state-dir", state_dir, *ports)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [again.stderr.strip()]
    assert "already running" in again.stderr

    stopped = cluster_cli("down", "--state-dir", state_dir, "--timeout", "15")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.count("stopped node") == 3
    assert not [node["ip"] for node in state["nodes"] if group_exists(node["pgid"])]
    assert not (Path(state_dir) / "cluster.json").exists()
