"""What ``up`` recorded (``cluster.json``, the token) so that every other command acts on exactly
the processes it started, and whether a recorded node still runs."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

HEAD_IP = "127.0.0.1"  # where the dashboard and job API listen
# Ray rewrites a node address of 127.0.0.1 to the machine's network IP; 127.0.0.2 stays on loopback.
HEAD_NODE_IP = "127.0.0.2"
DEFAULT_STATE_DIR = ".raypar-cluster"
STATE_FILE = "cluster.json"
TOKEN_FILE = "auth_token"


class UserError(Exception):
    """A mistake the user can fix, reported as one ``error:`` line."""


def load_state(state_dir: Path) -> dict | None:
    path = state_dir / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def save_state(state_dir: Path, state: dict) -> None:
    # Through a temporary name: a crash mid-write must not lose the PIDs `down` needs.
    tmp = state_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(state_dir / STATE_FILE)


def require_state(state_dir: Path) -> dict:
    state = load_state(state_dir)
    if state is None:
        raise UserError(f"no cluster recorded in {state_dir}; start one with: python -m cluster.local up")
    return state


def write_token(state_dir: Path) -> Path:
    path = state_dir / TOKEN_FILE
    path.unlink(missing_ok=True)
    # Created owner-only, so the token never exists world-readable.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, as `ray get-auth-token --generate`
    return path


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may contain spaces


def group_alive(node: dict) -> bool:
    """True while the node's process group still has a process, and the group is still ours."""
    try:
        # When this process started the node (make demo), its exited leader stays a zombie,
        # still counted in its group, until reaped here.
        os.waitpid(node["pgid"], os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: started by another `up`
    started = start_time(node["pgid"])
    if started is not None and started != node["started"]:
        return False  # the pid now belongs to an unrelated process: never signal it
    # A leader that is gone is fine: Linux never reuses a pid still in use as a pgid, so survivors are ours.
    try:
        os.killpg(node["pgid"], 0)
    except ProcessLookupError:
        return False
    return True


def worker_node(state: dict, ip: str) -> dict:
    workers = {node["ip"]: node for node in state["nodes"] if node["ip"] != HEAD_NODE_IP}
    if ip not in workers:
        raise UserError(
            f"--node {ip} is not a worker node of this cluster; worker nodes: "
            f"{', '.join(workers) or 'none'} (the head holds the GCS: losing it ends the cluster)"
        )
    return workers[ip]
