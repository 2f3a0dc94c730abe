"""Shared fixtures: tiny datasets, and one local Ray cluster for the whole session."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from ray_jobs.data import synthesize, write_table

# Credentials for the S3 tests' moto server, set before the shared Ray cluster starts so its
# workers inherit them (moto accepts any). Where a bucket is comes from the test, never from here.
for _key, _value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                     ("AWS_DEFAULT_REGION", "us-east-1")):
    os.environ.setdefault(_key, _value)


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: needs the shared local Ray cluster")
    config.addinivalue_line("markers", "cluster: starts its own local multi-node Ray cluster")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster per test session: Ray start-up costs ~10 s here."""
    import ray

    from ray_jobs.session import start_local

    # 4 logical CPUs on a 2-core machine: two 1-CPU workers plus headroom for Ray's own actors.
    yield SimpleNamespace(dashboard_url=start_local(num_cpus=4))  # tests ask its state API
    ray.shutdown()


def _write(tmp_path_factory, name: str, **kwargs) -> str:
    path = str(tmp_path_factory.mktemp("data") / f"{name}.parquet")
    write_table(synthesize(**kwargs), path)
    return path


@pytest.fixture(scope="session")
def regression_data(tmp_path_factory) -> str:
    return _write(tmp_path_factory, "regression", rows=96, in_features=6, out_features=3, task="regression", seed=1)


@pytest.fixture(scope="session")
def classification_data(tmp_path_factory) -> str:
    return _write(
        tmp_path_factory, "classification", rows=96, in_features=6, out_features=4, task="classification", seed=2
    )


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on loopback for the session: ``host:port``; stopped by its PID."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)
