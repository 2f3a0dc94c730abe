"""One live run per name: the run directory's lease, on local storage (a flock) and on an object
store (a lease object with a heartbeat, exercised here through a file:// URI). No Ray."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from ray_jobs import ddp
from ray_jobs.driver import lease
from ray_jobs.driver.lease import LEASE_FILE, RunInUse, RunLease
from tests.helpers import REPO

HOLD = """
import sys, time
from ray_jobs.driver.lease import RunLease
held = RunLease()  # kept: the lock lives as long as its file is open
held.acquire(sys.argv[1], "run")
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lease of ``<tmp_path>/runs/run``; SIGKILLed at the end at the latest."""
    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    yield process, run_dir
    process.kill()
    process.wait(timeout=30)


def test_a_second_live_run_of_a_name_is_refused_in_one_line(holder, regression_data, capsys):
    process, run_dir = holder
    argv = ["--data", regression_data, "--batch-size", "16", "--name", "run", "--storage-path", str(run_dir.parent)]
    assert ddp.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"error: run 'run' is in use by {socket.gethostname()} pid {process.pid} since "
    )
    assert err[0].endswith("one live run per name; wait for it to end, or use another --name")
    assert sorted(os.listdir(run_dir)) == [LEASE_FILE]  # the refused run wrote nothing
    # A holder that dies, however it dies, lets the lease go with its process.
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    with RunLease() as taken:
        taken.acquire(str(run_dir), "run")
        assert json.loads((run_dir / LEASE_FILE).read_text())["pid"] == os.getpid()
    assert not (run_dir / LEASE_FILE).exists()  # released: nothing left behind


def write_owner(path, **changes) -> None:
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "since": 1.0e9, "heartbeat": time.time(), "token": "x"}
    path.write_text(json.dumps({**owner, **changes}))


def test_an_object_store_lease_is_refused_while_its_owner_beats_and_taken_over_after(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    uri = f"file://{run_dir}"
    write_owner(run_dir / LEASE_FILE, host="other-host", pid=1)  # alive: a fresh heartbeat
    with pytest.raises(RunInUse, match="run 'run' is in use by other-host pid 1 since 2001-09-"):
        RunLease().acquire(uri, "run")
    write_owner(run_dir / LEASE_FILE, host="other-host", pid=1, heartbeat=time.time() - 300)
    with RunLease() as taken:
        taken.acquire(uri, "run")
        assert json.loads((run_dir / LEASE_FILE).read_text())["token"] == taken.owner.token
    out = capsys.readouterr().out
    assert "taking over run 'run''s lease from other-host pid 1 since" in out and "(no heartbeat for 300 s)" in out
    assert not (run_dir / LEASE_FILE).exists()


def test_an_object_store_lease_of_a_dead_pid_on_this_host_is_taken_over_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lease, "SETTLE_S", 0.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_owner(run_dir / LEASE_FILE, pid=dead.pid)  # its heartbeat is fresh, its process gone
    with RunLease() as taken:
        taken.acquire(f"file://{run_dir}", "run")
    assert f"(pid {dead.pid} is gone from this host)" in capsys.readouterr().out
