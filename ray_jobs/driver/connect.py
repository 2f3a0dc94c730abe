"""Connecting to Ray: join the cluster a job was submitted to, or start a local one."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import ray

# Ray Train otherwise re-prints every worker line with a prefix, doubling the progress output.
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
API_SERVER_VARIABLE = "RAY_API_SERVER_ADDRESS"
# How long a cluster's GCS port has to accept a TCP connection. Ray's own client retries a dead
# address for minutes, printing warnings (measured: still waiting after 90 s for a closed port).
PROBE_TIMEOUT_S = 5.0
# How long ray.init may take once the port answered: ~10 s here for a healthy cluster; what hangs
# past this is a port that is not a Ray GCS (the dashboard's 8265, another service).
JOIN_TIMEOUT_S = 20.0
_started_here = False  # whether this process started the Ray it is connected to (``start_local``)
_local_daemons: list = []  # psutil.Process of each daemon that start_local's ray.init spawned here


def connect(address: str | None = None) -> None:
    """Join ``address`` (else ``RAY_ADDRESS``, as set inside ``ray job submit``); without either,
    start a fresh local Ray, whatever an old ``ray start`` left in /tmp/ray.

    Raises ``ValueError`` (one line: the address and what to check) when the address does not
    answer within ``PROBE_TIMEOUT_S + JOIN_TIMEOUT_S``."""
    if not ray.is_initialized():
        join(reachable(address), address)


def join(target: str | None, address: str | None = None) -> None:
    """``connect`` for an address ``reachable`` already checked (``target``; None: a local Ray),
    so an entry point that checks first does not probe it twice."""
    if ray.is_initialized():
        return
    if target is None:
        start_local()
        return
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    # Ray reads RAY_ADDRESS before its own argument: keep the two the same.
    os.environ["RAY_ADDRESS"] = target
    _join(target, _named(address))


def reachable(address: str | None) -> str | None:
    """The address a job will join (None: a local Ray), checked to answer: entry points call it
    before any other work, so a wrong address costs seconds, not a data load."""
    what = _named(address)
    address = address or os.environ.get("RAY_ADDRESS")
    if not address or address == "local":
        return None
    target = resolve(address, what)
    probe(target, what + (f" ({target})" if target != address else ""), recorded=address == "auto")
    return target


def _named(address: str | None) -> str:
    """How the user gave the address, for messages: the flag, or the environment variable."""
    return f"--address {address}" if address else f"RAY_ADDRESS {os.environ.get('RAY_ADDRESS')}"


def resolve(address: str, what: str) -> str:
    """``auto``: the cluster ``ray start`` recorded on this machine; anything else as given."""
    if address.startswith(("http://", "https://")):
        raise ValueError(
            f"{what} is a dashboard (job API) address, which `ray job submit --address` takes; "
            "a job joins the cluster's GCS: host:6379, or ray://host:10001"
        )
    if address != "auto":
        return address
    from ray._private.utils import get_ray_address_file, read_ray_address

    recorded = read_ray_address()
    if not recorded:
        raise ValueError(
            f"{what}: no Ray cluster is running on this machine (`ray start --head` records one "
            f"in {get_ray_address_file(None)}); start one, or drop --address to start a local Ray"
        )
    return recorded


def probe(address: str, what: str, recorded: bool = False, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Fail in seconds, in one line, when nothing accepts connections at ``address``'s host:port."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{what}: expected host:port (e.g. 10.0.0.5:6379), auto, or ray://host:10001")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except OSError as error:
        reason = error.strerror or type(error).__name__
    stale = " (the recorded head is gone: start it again with `ray start --head`)" if recorded else ""
    drop = "unset RAY_ADDRESS" if what.startswith("RAY_ADDRESS") else "drop --address"
    raise ValueError(
        f"{what}: no Ray cluster answers there ({reason}){stale}; check the address and that the "
        f"head node is up (`ray status --address ...`), or {drop} to start a local Ray"
    )


def _join(address: str, what: str) -> None:
    """``ray.init`` on a helper thread, bounded: a port that accepts connections but is not a Ray
    GCS would otherwise keep it retrying for minutes."""
    outcome: dict = {}

    def target() -> None:
        try:
            ray.init(address=address, log_to_driver=True)
            outcome["done"] = True
        except BaseException as error:  # re-raised on the caller's thread below
            outcome["error"] = error

    thread = threading.Thread(target=target, name="raypar-connect", daemon=True)
    thread.start()
    thread.join(JOIN_TIMEOUT_S)
    if "error" in outcome:
        error = outcome["error"]
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"{what}: could not join the Ray cluster there: {first}")
    if not outcome:
        raise ValueError(
            f"{what}: the port answers but no Ray cluster joined within {JOIN_TIMEOUT_S:g} s; "
            "is it the cluster's GCS port (6379 by default, not the dashboard's 8265)?"
        )


def start_local(**init_options: Any) -> str:
    """Start a fresh local Ray instance whose dashboard (and state API) listens on loopback only;
    returns the dashboard's URL."""
    url = f"http://127.0.0.1:{_free_port()}"
    os.environ.update(WORKER_ENV)
    # The cluster's processes inherit this environment. Ray Train's placement-group cleaner
    # finds the state API through RAY_API_SERVER_ADDRESS; without it, it guesses from the Ray
    # processes on the machine and fails when another Ray runs beside this one. The driver
    # drops it again: it would override the address of every job client made here.
    previous = os.environ.get(API_SERVER_VARIABLE)
    os.environ[API_SERVER_VARIABLE] = url
    try:
        # "local": a plain ray.init() would join whatever /tmp/ray/ray_current_cluster names, and
        # hang for as long as that head is gone (measured: over 8 minutes, silent).
        before = {child.pid for child in psutil.Process().children()}
        ray.init(
            address="local",
            dashboard_host="127.0.0.1",
            dashboard_port=int(url.rsplit(":", 1)[1]),
            log_to_driver=True,
            **init_options,
        )
        global _started_here
        _started_here = True
        _local_daemons[:] = [child for child in psutil.Process().children() if child.pid not in before]
    finally:
        if previous is None:
            os.environ.pop(API_SERVER_VARIABLE)
        else:
            os.environ[API_SERVER_VARIABLE] = previous
    return url


def ray_started_here() -> bool:
    """Whether this process started the local Ray it is connected to: that Ray, and everything
    placed on it, ends when this process does."""
    return _started_here and ray.is_initialized()


def end_local_ray_now() -> None:
    """SIGKILL every process below the daemons of the local Ray started here (its agents, workers
    and dashboard modules), for a process about to end without ``ray.shutdown()``.

    The daemons themselves die with this process: Ray starts them fate-sharing. Killing them here
    instead would race this process's exit, since Ray's core ends a driver whose raylet died with
    status 1. Left alone, the raylet's two agents noticed its death but took ~60 s to exit."""
    for daemon in _local_daemons:
        with contextlib.suppress(psutil.Error):  # gone already: so is what it started
            for process in daemon.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    process.kill()  # psutil checks the process is still the one it listed


def _free_port() -> int:
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        return probe_socket.getsockname()[1]


@contextlib.contextmanager
def env_defaults(defaults: dict[str, str]) -> Iterator[None]:
    """Set each of ``defaults`` in this process's environment for the block, unless the user set
    it: Ray reads its tuning variables where it builds what they size (a fit's controller, a read's
    footer pool), and a user's own value wins. Removed again on the way out, failure or not."""
    added = {name: value for name, value in defaults.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
