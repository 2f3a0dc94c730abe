"""Shared fixtures: tiny datasets, and one local Ray cluster for the whole session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from ray_jobs.core.config import TrainConfig
from ray_jobs.data.parquet import synthesize, write_table
from tests.helpers import write_parts, write_tokens

# Credentials for the S3 tests' moto server, set before the shared Ray cluster starts so its
# workers inherit them (moto accepts any). Where a bucket is comes from the test, never from here.
for _key, _value in (
    ("AWS_ACCESS_KEY_ID", "testing"),
    ("AWS_SECRET_ACCESS_KEY", "testing"),
    ("AWS_DEFAULT_REGION", "us-east-1"),
):
    os.environ.setdefault(_key, _value)
# Ray Train's own Prometheus metrics (a callback in each fit's controller and workers): no test
# reads them, and they cost ~0.8 CPU-s a fit on this 2-core machine (docs/performance.md). Users'
# runs keep Ray's default.
os.environ.setdefault("RAY_TRAIN_METRICS_ENABLED", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: needs the shared local Ray cluster")
    config.addinivalue_line("markers", "cluster: starts its own local multi-node Ray cluster")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(items):
    """Under ``pytest -n 2 --dist loadgroup`` (``make test``) the multi-node tests run one after
    another on one worker: they share module-scoped clusters, and each takes loopback addresses
    from 127.0.0.2 up. Every other test may go to either worker, each with a local Ray of its own."""
    for item in items:
        if "tests/cluster/" in item.nodeid:
            item.add_marker(pytest.mark.xdist_group("cluster"))


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster per test session: Ray start-up costs ~10 s here."""
    import ray

    from ray_jobs.driver.connect import start_local

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
def tokens(tmp_path_factory) -> str:
    """A language model's data: 48 rows of 8 + 1 byte tokens of real text."""
    return write_tokens(str(tmp_path_factory.mktemp("lm") / "train.parquet"), rows=48, block_size=8)


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on loopback for the session: ``host:port``; stopped by its PID."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
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


@pytest.fixture(scope="session")
def stream_data(tmp_path_factory) -> str:
    """``helpers.STREAM_FILES``: three files of uneven row groups, for streaming ingest."""
    return write_parts(tmp_path_factory.mktemp("stream"))


@pytest.fixture
def stream_cfg(stream_data, tmp_path) -> TrainConfig:
    # A 24-row window holds 2 to 5 row groups; global batches of 16 straddle windows.
    return TrainConfig(
        model="seed-mlp",
        hidden=8,
        data=stream_data,
        ingest="stream",
        shuffle_window_rows=24,
        epochs=2,
        batch_size=16,
        seed=9,
        momentum=0.9,
        storage_path=str(tmp_path),
        name="run",
    )


@pytest.fixture
def ray_tmpdir(monkeypatch):
    """A temp dir of Ray's own (RAY_TMPDIR), as /tmp is to a plain Ray: its ray/ray_current_cluster
    is the record ``ray start`` leaves. Short, for Ray's socket paths under it."""
    directory = tempfile.mkdtemp(prefix="rp")
    (Path(directory) / "ray").mkdir()
    monkeypatch.setenv("RAY_TMPDIR", directory)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield Path(directory)
    subprocess.run(["rm", "-rf", directory], check=False)


# A user's own model module (``--model module:callable``), written fresh for each test that asks.
USER_MODEL = """
from torch import nn

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


def build(in_features, out_features, hidden=4, act="relu", bias=True):
    return nn.Sequential(
        nn.Linear(in_features, hidden, bias=bias),
        ACTIVATIONS[act](),
        nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()),
        nn.Linear(hidden, out_features),
    )


def not_a_model(in_features, out_features):
    return 42


def fails(in_features, out_features, **options):
    raise RuntimeError("widths too small")


class Residual(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.fc(x)


def with_layers_ddp_cannot_match(in_features, out_features):
    return nn.Sequential(nn.Linear(in_features, 4), nn.BatchNorm1d(4), nn.Dropout(0.2), nn.Linear(4, out_features))
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A module of its own name (so no other test's import is cached) on the driver's path."""
    name = f"user_model_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name
