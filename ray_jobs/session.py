"""Connecting to Ray: join the cluster a job was submitted to, or start a local one."""
from __future__ import annotations

import os

import ray

# Ray Train otherwise re-prints every worker line with a prefix, doubling the progress output.
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def connect(address: str | None = None) -> None:
    """Join ``address`` (or ``RAY_ADDRESS``, as set inside ``ray job submit``); else start a local cluster."""
    if ray.is_initialized():
        return
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # The dashboard serves Ray's state API, which Ray Train's cleanup polls; loopback only.
        ray.init(dashboard_host="127.0.0.1", log_to_driver=True)
