"""Why a run stopped early, as a file in its run directory (``failure.json``): written by
whichever process saw it (world rank 0 of the workers, the pipeline's driver), read by the driver
to raise, kept for the user.
"""

from __future__ import annotations

import json

from ray_jobs.data import storage

FAILURE_FILE = "failure.json"


def record_failure(run_dir: str, reason: str) -> None:
    """Write why a run stopped early, for the driver to raise and the user to keep."""
    storage.write_bytes(storage.join(run_dir, FAILURE_FILE), json.dumps({"error": reason}).encode())


def recorded_failure(run_dir: str) -> str | None:
    path = storage.join(run_dir, FAILURE_FILE)
    return json.loads(storage.read_bytes(path))["error"] if storage.exists(path) else None
