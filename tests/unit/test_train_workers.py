"""Ray Train settings raypar applies around a fit (no Ray needed)."""

from __future__ import annotations

import os

import pytest

from ray_jobs.data_parallel.trainer import CONTROLLER_ENV, CONTROLLER_POLL_VARIABLE, PREEMPTION_WATCHER_VARIABLE
from ray_jobs.driver.connect import env_defaults
from tests.helpers import fresh_output


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


def test_a_training_process_loads_torch_with_no_collection_and_freezes_it():
    """A Ray Train worker's process-group join and a stage actor load torch and torch._dynamo
    with Python's collector paused (~0.4 CPU-seconds of each one's start): no collection runs in
    the import, the collector runs again after it, what the import built is frozen out of its
    walks, and a second call changes nothing."""
    code = (
        "import gc, sys\n"
        "from ray_jobs.core.torch_imports import load_torch_for_training\n"
        "runs = []\n"
        "gc.callbacks.append(lambda phase, info: runs.append(phase))\n"
        "load_torch_for_training()\n"
        "print(len(runs), gc.isenabled(), gc.get_freeze_count() > 100_000, 'torch._dynamo' in sys.modules)\n"
        "gc.unfreeze()\n"
        "load_torch_for_training()\n"
        "print(gc.get_freeze_count())"
    )
    assert fresh_output(code).split() == ["0", "True", "True", "True", "0"]
