"""``make demo``: DDP on a local multi-node Ray cluster, submitted the way users submit jobs.

Starts a local cluster (head + 2 worker nodes) unless one is already running, submits
``python -m ray_jobs.ddp`` with ``ray job submit --working-dir .``, streams its logs (which end
with the result table), and stops the cluster again if this script started it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from cluster import local

NUM_NODES = 2


def submit_command(state: dict, entrypoint: list[str]) -> list[str]:
    """``ray job submit`` against the local cluster, uploading the repo without its bulk."""
    return [
        *local.ray_command(),
        "job",
        "submit",
        "--address",
        state["dashboard_url"],
        "--working-dir",
        ".",
        "--runtime-env-json",
        json.dumps({"excludes": local.UPLOAD_EXCLUDES}),
        "--",
        *entrypoint,
    ]


def port_or_free(port: int) -> int:
    """The usual port, or any free one when another Ray on this machine already holds it."""
    try:
        local.require_free(port, "")
        return port
    except local.UserError:
        return local.free_port()


def main() -> int:
    state_dir = Path(local.DEFAULT_STATE_DIR).resolve()
    state = local.load_state(state_dir)
    started = not (state and any(local.group_alive(node) for node in state["nodes"]))
    ports = [
        "--port",
        str(port_or_free(local.DEFAULT_PORT)),
        "--dashboard-port",
        str(port_or_free(local.DEFAULT_DASHBOARD_PORT)),
    ]
    if started and local.main(["up", "--num-nodes", str(NUM_NODES), "--state-dir", str(state_dir), *ports]) != 0:
        return 1
    try:
        state = local.load_state(state_dir)
        runs = Path("runs").resolve()
        name = f"demo-{datetime.now():%Y%m%d-%H%M%S}"
        entrypoint = [
            "python",
            "-m",
            "ray_jobs.ddp",
            "--num-workers",
            str(NUM_NODES),
            "--epochs",
            "3",
            "--placement-strategy",
            "SPREAD",
            "--storage-path",
            str(runs),
            "--name",
            name,
        ]
        code = subprocess.call(submit_command(state, entrypoint), env=local.ray_env(state))
        if code == 0:
            print(f"\nresult: {runs / name / 'model.pt'} and {runs / name / 'summary.json'}")
        return code
    finally:
        if started:
            local.main(["down", "--state-dir", str(state_dir)])


if __name__ == "__main__":
    sys.exit(main())
