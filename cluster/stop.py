"""Stopping nodes: ``down`` (every recorded node, workers first, SIGTERM then SIGKILL) and
``preempt`` (one worker node's every process at once, as a spot preemption would)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from pathlib import Path

from cluster.state import HEAD_NODE_IP, STATE_FILE, UserError, group_alive, load_state, require_state, worker_node


def down(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir).resolve()
    state = load_state(state_dir)
    if state is None:
        print(f"no cluster recorded in {state_dir}; nothing to stop")
        return 0
    stopped = stop_nodes(state_dir, state, args.timeout)
    for node in stopped:
        print(f"stopped node {node['ip']} (process group {node['pgid']})")
    if not stopped:
        print(f"the cluster recorded in {state_dir} was no longer running; its record is cleared")
    print(f"logs kept in {state_dir / 'logs'} and {state['temp_dir']}")
    return 0


def stop_nodes(state_dir: Path, state: dict, timeout: float) -> list[dict]:
    """Stop the workers, then the head; forget the cluster. Returns the nodes that were running."""
    running = [node for node in state["nodes"] if group_alive(node)]
    # Workers first: a worker whose head is already gone hangs in shutdown retrying the GCS.
    workers = [node for node in running if node["ip"] != HEAD_NODE_IP]
    terminate_groups(workers, timeout)
    terminate_groups([node for node in running if node["ip"] == HEAD_NODE_IP], timeout)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    Path(state["token_path"]).unlink(missing_ok=True)
    return running


def terminate_groups(nodes: list[dict], timeout: float) -> None:
    """SIGTERM each node's process group, then SIGKILL whatever is left after ``timeout`` seconds."""
    for node in nodes:
        os.killpg(node["pgid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(group_alive(node) for node in nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    for node in nodes:
        if group_alive(node):
            print(
                f"node {node['ip']} (process group {node['pgid']}) ignored SIGTERM for {timeout:.0f} s; sending SIGKILL"
            )
            os.killpg(node["pgid"], signal.SIGKILL)


def preempt(args: argparse.Namespace) -> int:
    """SIGKILL every process of one worker node at once, as a spot preemption or a hardware loss
    would: no drain, no goodbye to the GCS. The rest of the cluster stays up."""
    state = require_state(Path(args.state_dir).resolve())
    node = worker_node(state, args.node)
    if not group_alive(node):
        raise UserError(f"node {args.node} is not running")
    members = session_members(node["pgid"])
    for pid in members:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    print(f"preempted node {args.node}: killed {len(members)} processes; Ray marks it dead within ~15 s")
    return 0


def session_members(session_id: int) -> list[int]:
    """Every process of a session (Linux /proc): a node's raylet, agents and the Ray workers it
    started, which make process groups of their own but stay in the node's session."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The fields after the command name, which may itself hold spaces and parentheses.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == session_id:
            members.append(int(stat.parent.name))
    return members
