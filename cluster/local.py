"""A multi-node Ray cluster on one machine: ``python -m cluster.local up|status|preempt|rejoin|down``.

Each node is one ``ray start --block`` process in its own process group, on its own loopback
address (head 127.0.0.2, worker i 127.0.0.(i+3)), so Ray sees distinct nodes: node ranks differ
and SPREAD placement behaves as on real machines. The dashboard and job API listen on
127.0.0.1 only, token authentication is on, and ``down`` signals only the process groups that
``up`` recorded: never ``ray stop``, which would also stop every other Ray on the machine.
``preempt`` kills one worker node's every process at once, as a spot preemption would, and
``rejoin`` starts it again, as an autoscaler would replace it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.error
import urllib.request
from pathlib import Path

HEAD_IP = "127.0.0.1"  # where the dashboard and job API listen
# Ray rewrites a node address of 127.0.0.1 to the machine's network IP; 127.0.0.2 stays on loopback.
HEAD_NODE_IP = "127.0.0.2"
DEFAULT_STATE_DIR = ".raypar-cluster"
DEFAULT_PORT = 6389  # not Ray's 6379, so a plain `ray start --head` can still run beside it
DEFAULT_DASHBOARD_PORT = 8265
STATE_FILE = "cluster.json"
# `ray start` prints this once the node is fully up; a SIGTERM before then can leave it hanging.
STARTED_MARKER = "Ray runtime started."
TOKEN_FILE = "auth_token"
# What `ray job submit --working-dir .` need not upload (the upload limit is 100 MiB).
UPLOAD_EXCLUDES = [".venv", ".git", "runs", "data", DEFAULT_STATE_DIR]


class UserError(Exception):
    """A mistake the user can fix, reported as one ``error:`` line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line, without the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# ---- state: what `up` started, so `status` and `down` act on exactly that -------------------


def load_state(state_dir: Path) -> dict | None:
    path = state_dir / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def save_state(state_dir: Path, state: dict) -> None:
    # Through a temporary name: a crash mid-write must not lose the PIDs `down` needs.
    tmp = state_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(state_dir / STATE_FILE)


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


# ---- up ------------------------------------------------------------------------------------


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


# ---- status --------------------------------------------------------------------------------


def fetch_nodes(state: dict, what: str = "nodes") -> list[dict]:
    """Nodes (or ``what`` else Ray's state API lists: ``actors``, ...), asked with the cluster's token."""
    token = Path(state["token_path"]).read_text().strip()
    request = urllib.request.Request(
        f"{state['dashboard_url']}/api/v0/{what}?limit=1000", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        raise UserError(f"{state['dashboard_url']} answered {error.code} {error.reason}") from None
    return body["data"]["result"]["result"]


def require_state(state_dir: Path) -> dict:
    state = load_state(state_dir)
    if state is None:
        raise UserError(f"no cluster recorded in {state_dir}; start one with: python -m cluster.local up")
    return state


def format_resources(resources: dict) -> str:
    shown = {k: v for k, v in resources.items() if not k.startswith(("node:", "object_store_memory", "memory"))}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(shown.items()))


def status(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir).resolve()
    state = require_state(state_dir)
    if not any(group_alive(node) for node in state["nodes"]):
        raise UserError(
            f"the cluster recorded in {state_dir} is not running; clear it with: python -m cluster.local down"
        )
    try:
        nodes = fetch_nodes(state)
    except OSError as error:
        raise UserError(f"cannot reach {state['dashboard_url']}: {error}") from None
    print(f"address {state['address']}  dashboard {state['dashboard_url']}  token file {state['token_path']}")
    print(f"{'node ip':<12} {'head':<5} {'state':<6} resources")
    for node in sorted(nodes, key=lambda n: tuple(int(p) for p in n["node_ip"].split("."))):
        head = "yes" if node["is_head_node"] else ""
        print(f"{node['node_ip']:<12} {head:<5} {node['state']:<6} {format_resources(node['resources_total'])}")
    return 0


# ---- down ----------------------------------------------------------------------------------


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


# ---- preempt -------------------------------------------------------------------------------


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


def worker_node(state: dict, ip: str) -> dict:
    workers = {node["ip"]: node for node in state["nodes"] if node["ip"] != HEAD_NODE_IP}
    if ip not in workers:
        raise UserError(
            f"--node {ip} is not a worker node of this cluster; worker nodes: "
            f"{', '.join(workers) or 'none'} (the head holds the GCS: losing it ends the cluster)"
        )
    return workers[ip]


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


# ---- command line --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--state-dir",
        default=DEFAULT_STATE_DIR,
        help=f"where PIDs, the token and logs go (default: ./{DEFAULT_STATE_DIR})",
    )
    parser = ArgumentParser(
        prog="python -m cluster.local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    start = commands.add_parser("up", parents=[common], help="start a head and --num-nodes worker nodes")
    start.add_argument("--num-nodes", type=int, default=2, help="worker nodes besides the head (default: 2)")
    start.add_argument("--cpus-per-node", type=int, default=1, help="logical CPUs per worker node (default: 1)")
    start.add_argument(
        "--head-cpus",
        type=int,
        default=0,
        help="logical CPUs of the head, 0 keeps training off it as on the cloud configs (default: 0)",
    )
    start.add_argument(
        "--resources", default=None, help="custom resources per worker node, JSON, e.g. '{\"accel\": 1}'"
    )
    start.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"GCS port of the head (default: {DEFAULT_PORT})")
    start.add_argument(
        "--dashboard-port",
        type=int,
        default=DEFAULT_DASHBOARD_PORT,
        help=f"dashboard and job API port on {HEAD_IP} (default: {DEFAULT_DASHBOARD_PORT})",
    )
    start.add_argument(
        "--timeout", type=float, default=120, help="seconds to wait for every node to join (default: 120)"
    )
    start.set_defaults(run=up)
    show = commands.add_parser("status", parents=[common], help="list the nodes: ip, state, resources")
    show.set_defaults(run=status)
    stop = commands.add_parser("down", parents=[common], help="stop exactly the processes `up` started")
    stop.add_argument("--timeout", type=float, default=20, help="seconds between SIGTERM and SIGKILL (default: 20)")
    stop.set_defaults(run=down)
    lose = commands.add_parser(
        "preempt", parents=[common], help="kill one worker node's every process at once, as a spot preemption would"
    )
    lose.add_argument("--node", required=True, help="the worker node's IP, as `status` lists it (e.g. 127.0.0.3)")
    lose.set_defaults(run=preempt)
    back = commands.add_parser(
        "rejoin", parents=[common], help="start a lost worker node again, as an autoscaler replaces a preempted one"
    )
    back.add_argument("--node", required=True, help="the lost worker node's IP (e.g. 127.0.0.3)")
    back.add_argument("--timeout", type=float, default=60, help="seconds to wait for it to join (default: 60)")
    back.set_defaults(run=rejoin)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
