"""Ray Train settings raypar applies around a fit (no Ray needed)."""

from __future__ import annotations

import os

import pytest

from ray_jobs.data_parallel.trainer import CONTROLLER_ENV, CONTROLLER_POLL_VARIABLE, PREEMPTION_WATCHER_VARIABLE
from ray_jobs.driver.connect import env_defaults


@pytest.fixture
def unset(monkeypatch):
    for name in CONTROLLER_ENV:
        monkeypatch.delenv(name, raising=False)


def test_the_controller_settings_hold_for_the_fit_only(unset):
    with env_defaults(CONTROLLER_ENV):
        # what fit() passes to the controller
        assert os.environ[CONTROLLER_POLL_VARIABLE] == "0.5" and os.environ[PREEMPTION_WATCHER_VARIABLE] == "0"
    assert not set(CONTROLLER_ENV) & set(os.environ)


def test_a_users_own_setting_wins(unset, monkeypatch):
    monkeypatch.setenv(PREEMPTION_WATCHER_VARIABLE, "1")
    with env_defaults(CONTROLLER_ENV):
        assert os.environ[PREEMPTION_WATCHER_VARIABLE] == "1" and os.environ[CONTROLLER_POLL_VARIABLE] == "0.5"
    assert os.environ[PREEMPTION_WATCHER_VARIABLE] == "1" and CONTROLLER_POLL_VARIABLE not in os.environ


def test_the_settings_are_removed_when_the_fit_fails(unset):
    with pytest.raises(RuntimeError), env_defaults(CONTROLLER_ENV):
        raise RuntimeError("fit failed")
    assert not set(CONTROLLER_ENV) & set(os.environ)
