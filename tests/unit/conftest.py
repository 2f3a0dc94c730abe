"""The unit lane: torch and pyarrow only. A test here that would start or join Ray fails at once,
naming the lane it belongs in, instead of quietly costing a Ray start (~10 s here)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    import ray

    def refuse(*_args, **_kwargs):
        raise RuntimeError("a test in tests/unit started Ray: move it to tests/ray (or tests/cluster)")

    monkeypatch.setattr(ray, "init", refuse)
