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
import sys
import typing

from cluster.start import UPLOAD_EXCLUDES, free_port, ray_command, ray_env, rejoin, require_free, up
from cluster.state import DEFAULT_STATE_DIR, HEAD_IP, HEAD_NODE_IP, UserError, group_alive, load_state
from cluster.status import fetch_nodes, status
from cluster.stop import down, preempt

DEFAULT_PORT = 6389  # not Ray's 6379, so a plain `ray start --head` can still run beside it
DEFAULT_DASHBOARD_PORT = 8265

# What cluster/demo.py, tests/helpers.py and tests/cluster use, kept importable from the entry point.
__all__ = [
    "DEFAULT_DASHBOARD_PORT",
    "DEFAULT_PORT",
    "DEFAULT_STATE_DIR",
    "HEAD_NODE_IP",
    "UPLOAD_EXCLUDES",
    "UserError",
    "build_parser",
    "fetch_nodes",
    "free_port",
    "group_alive",
    "load_state",
    "main",
    "ray_command",
    "ray_env",
    "require_free",
]


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line, without the usage block."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
