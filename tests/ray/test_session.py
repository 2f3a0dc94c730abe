"""Which Ray a job joins without --address: a fresh local one, whatever /tmp/ray holds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, closed_port


@pytest.mark.ray
def test_without_an_address_a_stale_record_is_ignored(ray_tmpdir):
    """A head killed rather than stopped leaves its record; a plain ray.init() would join it and
    wait for as long as it is gone (measured: over 8 minutes)."""
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{closed_port()}\n")
    script = (
        "import ray; from ray_jobs.driver.connect import connect; connect(); "
        "print('cpus', ray.get(ray.remote(lambda: ray.cluster_resources()['CPU']).remote()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cpus" in result.stdout
