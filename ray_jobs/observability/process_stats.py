"""Readings of the machine and of this process that the training loops and the bench record.

CPU steal, the share of a VM's CPU time its hypervisor gave to other guests: on a shared cloud
VM it slows a run without any process on the machine showing it, so the loops record it per
epoch and the bench per run; a slow epoch with high steal is the host's, not the code's.
Peak RSS per worker: whether each worker holds its own copy of what one copy would serve.
"""

from __future__ import annotations

import resource
import sys


def cpu_times() -> tuple[int, int] | None:
    """All CPU time and the part stolen so far, in clock ticks (Linux ``/proc/stat``), else None."""
    try:
        with open("/proc/stat") as handle:
            fields = [int(v) for v in handle.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(fields), fields[7]) if len(fields) == 8 else None


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of the CPU time between two ``cpu_times`` readings that was stolen; None if unknown."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def rss_bytes() -> int | None:
    """This process's resident memory now (Linux VmRSS), else None."""
    return _status_bytes("VmRSS:")


def reset_peak_rss() -> bool:
    """Start VmHWM again from the current RSS (Linux ``clear_refs`` 5), so a later ``peak_rss_bytes``
    is the peak of what came after; False where that cannot be done (the peak then covers earlier)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM (reset by exec, unlike ru_maxrss), else getrusage."""
    peak = _status_bytes("VmHWM:")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
