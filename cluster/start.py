"""Starting nodes: ``up`` (a head, then the workers, each recorded before the next starts) and
``rejoin`` (a lost worker node again, as an autoscaler replaces it)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster.state import (
    DEFAULT_STATE_DIR,
    HEAD_IP,
    HEAD_NODE_IP,
    UserError,
    group_alive,
    load_state,
    require_state,
    save_state,
    start_time,
    worker_node,
    write_token,
)
from cluster.status import fetch_nodes
from cluster.stop import stop_nodes

# `ray start` prints this once the node is fully up; a SIGTERM before then can leave it hanging.
STARTED_MARKER = "Ray runtime started."
# What `ray job submit --working-dir .` need not upload (the upload limit is 100 MiB).
UPLOAD_EXCLUDES = [".venv", ".git", "runs", "data", DEFAULT_STATE_DIR]


def up(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir).resolve()
    refuse_second_cluster(state_dir)
    check_up_args(args)
    resources = parse_resources(args.resources)
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    state = {
        "address": f"{HEAD_NODE_IP}:{args.port}",
        "dashboard_url": f"http://{HEAD_IP}:{args.dashboard_port}",
        "token_path": str(write_token(state_dir)),
        # Short and outside the repo: Ray's socket paths under it must stay below 108 bytes.
        "temp_dir": str(Path(tempfile.gettempdir()) / f"raypar-{args.port}"),
        "resources": resources,
        "nodes": [],
    }
    try:
        start_nodes(args, state_dir, state)
        wait_for_nodes(state, len(state["nodes"]), args.timeout)
    except BaseException:
        stop_nodes(state_dir, state, timeout=10)
        raise
    print_usage(state_dir, state, args.num_nodes)
    return 0


def check_up_args(args: argparse.Namespace) -> None:
    if not 1 <= args.num_nodes <= 250:
        raise UserError(f"--num-nodes must be between 1 and 250 (one loopback address each), got {args.num_nodes}")
    for flag in ("cpus_per_node", "head_cpus"):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} must be zero or more, got {getattr(args, flag)}")
    if args.port == args.dashboard_port:
        raise UserError(f"--port and --dashboard-port must differ, both are {args.port}")
    require_free(args.port, "--port")
    require_free(args.dashboard_port, "--dashboard-port")


def parse_resources(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        resources = json.loads(text)
    except json.JSONDecodeError:
        resources = None
    ok = isinstance(resources, dict) and all(isinstance(v, (int, float)) and v >= 0 for v in resources.values())
    if not ok:
        raise UserError(f"--resources {text!r} must be a JSON object of names to amounts, e.g. '{{\"accel\": 1}}'")
    return json.dumps(resources)


def refuse_second_cluster(state_dir: Path) -> None:
    state = load_state(state_dir)
    if state and any(group_alive(node) for node in state["nodes"]):
        raise UserError(
            f"a cluster from {state_dir} is already running at {state['address']}; "
            f"stop it first with: python -m cluster.local down --state-dir {state_dir}"
        )


def start_nodes(args: argparse.Namespace, state_dir: Path, state: dict) -> None:
    """Start the head, then the workers, recording each one before starting the next."""
    env = ray_env(state)
    temp_dir = Path(state["temp_dir"])
    head = [
        "--head",
        "--port",
        str(args.port),
        "--include-dashboard",
        "true",
        "--dashboard-host",
        HEAD_IP,
        "--dashboard-port",
        str(args.dashboard_port),
        "--ray-client-server-port",
        str(free_port()),
    ]
    plan = [(HEAD_NODE_IP, args.head_cpus, head)] + [
        (ip, args.cpus_per_node, worker_flags(state)) for ip in worker_ips(args.num_nodes)
    ]
    for ip, num_cpus, extra in plan:
        node = launch(node_command(ip, temp_dir, num_cpus, extra), env, state_dir / "logs" / f"node-{ip}.log")
        state["nodes"].append({"ip": ip, "num_cpus": num_cpus, **node})
        save_state(state_dir, state)


def worker_flags(state: dict) -> list[str]:
    return ["--address", state["address"], *(["--resources", state["resources"]] if state["resources"] else [])]


def ray_command() -> list[str]:
    # The Ray of this interpreter, not whatever `ray` is first on PATH: client and cluster must match.
    return [sys.executable, "-m", "ray.scripts.scripts"]


def ray_env(state: dict) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    # RAY_AUTH_TOKEN would override the file; RAY_ADDRESS would point nodes at another cluster.
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=state["token_path"])
    # Ray Train's placement-group cleaner finds the state API through this; without it, it guesses
    # from the GCS processes on the machine and fails when another Ray runs beside this one.
    env["RAY_API_SERVER_ADDRESS"] = state["dashboard_url"]
    # On SIGTERM a node otherwise drains for 30 s (for Ray Serve) before it stops; `down` wants it now.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    # Jobs run `python -m ray_jobs...` with the nodes' PATH: make that this interpreter.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def node_command(ip: str, temp_dir: Path, num_cpus: int, extra: list[str]) -> list[str]:
    return [
        *ray_command(),
        "start",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address",
        ip,
        "--num-cpus",
        str(num_cpus),
        # Every simulated node would otherwise claim all of the machine's GPUs.
        "--num-gpus",
        "0",
        # Its own temp dir: the default /tmp/ray would make a plain ray.init() join this cluster.
        "--temp-dir",
        str(temp_dir / ip),
        # Ray's fixed defaults (agent 52365, workers 10002-19999) collide between nodes on one machine.
        "--dashboard-agent-listen-port",
        "0",
        "--min-worker-port",
        "0",
        "--max-worker-port",
        "0",
        *extra,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HEAD_IP, 0))
        return s.getsockname()[1]


def require_free(port: int, flag: str) -> None:
    with socket.socket() as s:
        # SO_REUSEADDR: a port left in TIME_WAIT by a stopped cluster is free; a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HEAD_IP, port))
        except OSError:
            raise UserError(f"{flag} {port}: {HEAD_IP}:{port} is already in use; pick another with {flag}") from None


def launch(command: list[str], env: dict[str, str], log_path: Path) -> dict:
    with open(log_path, "wb") as log:
        # A new session makes the node its own process group, which `down` signals as a whole.
        proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return {"pid": proc.pid, "pgid": proc.pid, "started": start_time(proc.pid), "log": str(log_path)}


def worker_ips(num_nodes: int) -> list[str]:
    return [f"127.0.0.{i + 3}" for i in range(num_nodes)]


def wait_for_nodes(state: dict, expected: int, timeout: float) -> None:
    print(
        f"waiting up to {timeout:.0f} s for {expected} nodes (head + {expected - 1} workers) "
        f"to join {state['address']} ...",
        flush=True,
    )
    deadline, seen, last_error = time.monotonic() + timeout, -1, "no answer yet"
    while time.monotonic() < deadline:
        for node in state["nodes"]:
            if not group_alive(node):
                raise UserError(f"node {node['ip']} exited while starting; see {node['log']}")
        try:
            alive = sum(n["state"] == "ALIVE" for n in fetch_nodes(state))
        except (OSError, UserError) as error:
            alive, last_error = 0, str(error)  # the dashboard is not serving yet
        if alive >= expected and all(STARTED_MARKER in Path(n["log"]).read_text() for n in state["nodes"]):
            return
        if alive != seen:
            print(f"  {alive}/{expected} nodes alive", flush=True)
            seen = alive
        time.sleep(1)
    raise UserError(
        f"timed out after {timeout:.0f} s waiting for {expected} nodes to join (last: {last_error}); "
        f"logs in {Path(state['nodes'][0]['log']).parent}"
    )


def print_usage(state_dir: Path, state: dict, num_nodes: int) -> None:
    token, url = state["token_path"], state["dashboard_url"]
    excludes = json.dumps({"excludes": UPLOAD_EXCLUDES})
    ray = Path(sys.executable).with_name("ray")
    runs = Path.cwd() / "runs"
    print(f"Ray cluster up: head {HEAD_NODE_IP} + {num_nodes} worker nodes ({', '.join(worker_ips(num_nodes))})")
    print(f"  address:    {state['address']}")
    print(f"  dashboard:  {url}  (loopback only; the browser asks for the token)")
    print(f"  token file: {token}")
    print("Submit a job from the repo root:")
    print(
        f"  RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(cat {token}) {ray} job submit --address {url} \\\n"
        f"    --working-dir . --runtime-env-json '{excludes}' \\\n"
        f"    -- python -m ray_jobs.ddp --num-workers {num_nodes} --batch-size {16 * num_nodes} "
        f"--placement-strategy SPREAD --storage-path {runs}"
    )
    print(f"Status: python -m cluster.local status --state-dir {state_dir}")
    print(f"Stop:   python -m cluster.local down --state-dir {state_dir}")


def rejoin(args: argparse.Namespace) -> int:
    """Start a lost worker node again, on its address with its CPUs and resources, as a cloud
    autoscaler replaces a preempted spot instance; Ray sees a new node."""
    state_dir = Path(args.state_dir).resolve()
    state = require_state(state_dir)
    node = worker_node(state, args.node)
    if group_alive(node):
        raise UserError(f"node {args.node} is running; only a lost node rejoins (see `preempt`)")
    if not group_alive(next(n for n in state["nodes"] if n["ip"] == HEAD_NODE_IP)):
        raise UserError(f"the head of the cluster recorded in {state_dir} is not running; start a new one with `up`")
    if "num_cpus" not in node:
        raise UserError(
            f"the cluster in {state_dir} was started by an older cluster.local that did not record "
            "its nodes' CPUs; `down` and `up` it again to use rejoin"
        )
    starts = node.get("starts", 1) + 1
    log = state_dir / "logs" / f"node-{args.node}-{starts}.log"  # a fresh log, for its started marker
    command = node_command(args.node, Path(state["temp_dir"]), node["num_cpus"], worker_flags(state))
    node.update(launch(command, ray_env(state), log), starts=starts)
    save_state(state_dir, state)
    wait_for_node(state, node, args.timeout)
    print(f"node {args.node} rejoined {state['address']} with {node['num_cpus']} CPU")
    return 0


def wait_for_node(state: dict, node: dict, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not group_alive(node):
            raise UserError(f"node {node['ip']} exited while starting; see {node['log']}")
        started = STARTED_MARKER in Path(node["log"]).read_text()
        if started and any(n["node_ip"] == node["ip"] and n["state"] == "ALIVE" for n in fetch_nodes(state)):
            return
        time.sleep(1)
    raise UserError(f"timed out after {timeout:.0f} s waiting for node {node['ip']} to join; see {node['log']}")
