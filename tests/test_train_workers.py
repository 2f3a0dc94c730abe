"""Ray Train settings raypar applies around a fit (no Ray needed)."""
from __future__ import annotations

import os

import pytest

from ray_jobs.train_workers import CONTROLLER_POLL_VARIABLE, _controller_poll


def test_the_controller_poll_is_set_for_the_fit_only(monkeypatch):
    monkeypatch.delenv(CONTROLLER_POLL_VARIABLE, raising=False)
    with _controller_poll("0.5"):
        assert os.environ[CONTROLLER_POLL_VARIABLE] == "0.5"  # what fit() passes to the controller
    assert CONTROLLER_POLL_VARIABLE not in os.environ


def test_a_users_controller_poll_wins(monkeypatch):
    monkeypatch.setenv(CONTROLLER_POLL_VARIABLE, "3")
    with _controller_poll("0.5"):
        assert os.environ[CONTROLLER_POLL_VARIABLE] == "3"
    assert os.environ[CONTROLLER_POLL_VARIABLE] == "3"


def test_the_controller_poll_is_removed_when_the_fit_fails(monkeypatch):
    monkeypatch.delenv(CONTROLLER_POLL_VARIABLE, raising=False)
    with pytest.raises(RuntimeError), _controller_poll("0.5"):
        raise RuntimeError("fit failed")
    assert CONTROLLER_POLL_VARIABLE not in os.environ
