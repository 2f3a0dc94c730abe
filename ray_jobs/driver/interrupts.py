"""Ctrl-C and SIGTERM: stop a run at a safe point, within seconds, whatever it is waiting on.

The run goes on a helper thread; the signal handlers only set ``STOP``. Strategies call
``check()`` where stopping is safe (between batches, while waiting on Ray Train), so no
exception lands inside a Ray call that is half done (which can crash a compiled graph).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import TypeVar

STOP = threading.Event()
# How long a stop may take to reach a safe point before the caller gives up waiting.
GRACE_S = 30.0

Result = TypeVar("Result")


def check() -> None:
    """Raise ``KeyboardInterrupt`` once a stop was requested."""
    if STOP.is_set():
        raise KeyboardInterrupt


def stop_requested() -> bool:
    """Whether Ctrl-C or SIGTERM arrived during this process's run."""
    return STOP.is_set()


def run_until_interrupted(work: Callable[[], Result]) -> Result:
    """Run ``work`` on a helper thread; SIGINT/SIGTERM ask it to stop (call from the main thread)."""
    STOP.clear()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: STOP.set())
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = work()
        except BaseException as error:  # re-raised on the calling thread below
            outcome["error"] = error

    thread = threading.Thread(target=target, name="raypar-run", daemon=True)
    thread.start()
    while thread.is_alive() and not STOP.is_set():
        thread.join(timeout=0.2)
    if STOP.is_set():
        thread.join(timeout=GRACE_S)
        raise KeyboardInterrupt
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
