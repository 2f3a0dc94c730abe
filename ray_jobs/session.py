"""Connecting to Ray: join the cluster a job was submitted to, or start a local one."""
from __future__ import annotations

import os
import socket
from typing import Any

import ray

# Ray Train otherwise re-prints every worker line with a prefix, doubling the progress output.
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
API_SERVER_VARIABLE = "RAY_API_SERVER_ADDRESS"


def connect(address: str | None = None) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``, as set inside ``ray job submit``); else start a local cluster."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        for key, value in WORKER_ENV.items():
            os.environ.setdefault(key, value)
        ray.init(address=address, log_to_driver=True)
    else:
        start_local()


def start_local(**init_options: Any) -> str:
    """Start a local Ray instance whose dashboard (and state API) listens on loopback only;
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
        ray.init(dashboard_host="127.0.0.1", dashboard_port=int(url.rsplit(":", 1)[1]), log_to_driver=True,
                 **init_options)
    finally:
        if previous is None:
            os.environ.pop(API_SERVER_VARIABLE)
        else:
            os.environ[API_SERVER_VARIABLE] = previous
    return url


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
