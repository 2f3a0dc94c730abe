"""Shared fixtures: tiny datasets, and one local Ray cluster for the whole session."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray_jobs.data import synthesize, write_table


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
