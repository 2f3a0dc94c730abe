"""One live run per name: a run holds a lease on its run directory while it trains.

Two runs of one name would write one directory, each resuming from the other's checkpoints, and
the ``model.pt`` left would be whichever wrote last. On local storage the lease is an exclusive
``flock`` on ``lease.json``, which the kernel lets go when its process ends, however it ends. An
object store has no locks: the lease is the object ``lease.json`` naming its owner (host, PID,
since when) and a heartbeat it rewrites; a lease whose heartbeat is older than ``STALE_S``, or
whose PID is gone from this very host, is taken over with a one-line notice, so a crash never
locks a run for good. Runs in the user's process (the driver), around prepare and training.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime

from ray_jobs.data import storage

LEASE_FILE = "lease.json"
# An owner rewrites its heartbeat this often; one silent for STALE_S is taken to be gone. Four
# missed beats: a storage hiccup or a paused VM does not lose a live run its lease.
HEARTBEAT_S = 30.0
STALE_S = 120.0
# An object store offers no conditional write through pyarrow: after writing its claim a run
# reads the lease back after this pause, and the later of two racing writers wins.
SETTLE_S = 1.0


@dataclass
class Owner:
    host: str
    pid: int
    since: float
    heartbeat: float
    token: str

    def describe(self) -> str:
        return f"{self.host} pid {self.pid} since {datetime.fromtimestamp(self.since):%Y-%m-%d %H:%M:%S}"

    def gone(self, now: float) -> str | None:
        """Why this owner is taken to be gone, or None while it may be alive."""
        if self.host == socket.gethostname() and not _pid_alive(self.pid):
            return f"pid {self.pid} is gone from this host"
        if now - self.heartbeat > STALE_S:
            return f"no heartbeat for {now - self.heartbeat:.0f} s"
        return None


class RunInUse(ValueError):
    """Another live run holds the name."""


class RunLease:
    """The lease of one run directory, for as long as the ``with`` block lasts."""

    def __init__(self) -> None:
        self.owner = Owner(socket.gethostname(), os.getpid(), time.time(), time.time(), uuid.uuid4().hex)
        self._file = None
        self._target: str | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *_exc) -> None:
        self.release()

    def acquire(self, run_dir: str, name: str) -> None:
        """Hold ``run_dir``'s lease, or raise ``RunInUse`` naming who holds it."""
        target = storage.join(run_dir, LEASE_FILE)
        if "://" in run_dir:
            self._acquire_object(target, name)
        else:
            self._acquire_local(target, name)
        self._target = target

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._target)  # before the lock goes: a waiter then finds the file gone
            self._file.close()  # closing lets the flock go
            self._file = None
        elif self._target is not None:
            with contextlib.suppress(OSError, ValueError):
                if _read_owner(self._target).token == self.owner.token:
                    storage.delete_file(self._target)
        self._target = None

    def _acquire_local(self, path: str, name: str) -> None:
        while True:
            file = open(path, "a+")  # noqa: SIM115 (held open for the run: the lock lives with it)
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.seek(0)
                held = _parse(file.read())
                file.close()
                raise RunInUse(_in_use(name, held)) from None
            # A releasing owner deletes the file: a lock on the deleted one is no lease; try anew.
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
                break
            file.close()
        file.seek(0)
        file.truncate(0)
        file.write(json.dumps(asdict(self.owner)))
        file.flush()
        self._file = file

    def _acquire_object(self, target: str, name: str) -> None:
        held = _read_owner_or_none(target)
        if held is not None and held.token != self.owner.token:
            why = held.gone(time.time())
            if why is None:
                raise RunInUse(_in_use(name, held))
            print(f"[raypar] taking over run {name!r}'s lease from {held.describe()} ({why})", flush=True)
        self._write(target)
        time.sleep(SETTLE_S)
        winner = _read_owner_or_none(target)
        if winner is None or winner.token != self.owner.token:
            raise RunInUse(_in_use(name, winner))
        self._beat = threading.Thread(target=self._heartbeat, args=(target,), name="raypar-lease", daemon=True)
        self._beat.start()

    def _write(self, target: str) -> None:
        self.owner.heartbeat = time.time()
        storage.write_bytes(target, json.dumps(asdict(self.owner)).encode())

    def _heartbeat(self, target: str) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write(target)
            except OSError as error:  # a missed beat; the next may land (STALE_S allows four)
                print(f"[raypar] warning: the run's lease heartbeat failed: {error}", file=sys.stderr, flush=True)


def _in_use(name: str, held: Owner | None) -> str:
    who = held.describe() if held is not None else "another run"
    return f"run {name!r} is in use by {who}: one live run per name; wait for it to end, or use another --name"


def _read_owner(target: str) -> Owner:
    owner = _parse(storage.read_bytes(target).decode(errors="replace"))
    if owner is None:
        raise ValueError(f"{storage.without_query(target)} is not a lease")
    return owner


def _read_owner_or_none(target: str) -> Owner | None:
    try:
        return _read_owner(target)
    except (FileNotFoundError, ValueError):
        return None


def _parse(text: str) -> Owner | None:
    try:
        return Owner(**json.loads(text))
    except (ValueError, TypeError):  # empty (released), or not ours
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
