"""A failed run's root cause in one line, whichever process it happened in.

Workers and stages describe their own failures (``Failure``: where, then what), because only they
know their world rank or stage index; the driver unwraps Ray's layers down to that description,
or to the innermost error when there is none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class TrainingFailed(RuntimeError):
    """The run ended with an error; its message is the root cause, in one line."""


class Failure(RuntimeError):
    """An error inside a worker or stage, already described in one line: where, then what."""


def describe(error: BaseException, where: str) -> str:
    """``where: what`` in one line; CUDA running out of memory is named as such."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    if isinstance(error, torch.OutOfMemoryError):
        return (
            f"{where}: {first}" if first.startswith("CUDA out of memory") else f"{where}: CUDA out of memory ({first})"
        )
    return f"{where}: {type(error).__name__}: {first}" if first else f"{where}: {type(error).__name__}"


@contextlib.contextmanager
def described(where: str, passing: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Re-raise an error from the block as a ``Failure`` naming ``where``; a ``Failure`` (already
    described) and the ``passing`` types go through as they are."""
    try:
        yield
    except (Failure, *passing):
        raise
    except Exception as error:
        raise Failure(describe(error, where)) from error


def os_error_line(error: OSError) -> str:
    """An ``OSError`` as one line: the path first, then what the system said of it."""
    if error.filename is None or not error.strerror:
        return f"{type(error).__name__}: {error}"
    return f"{error.filename}: {error.strerror}"


# What an OSError says when a write failed for lack of room or rights (errno 28, 13, 30).
WRITE_FAILURES = ("No space left on device", "Permission denied", "Read-only file system", "errno 28", "Errno 28")


def storage_named(cause: str, run_dir: str) -> str:
    """A root cause that a failed write left, with where it was writing: Ray Train's checkpoint
    uploads and registry writes say what the system said but not where."""
    if any(failure in cause for failure in WRITE_FAILURES) and run_dir not in cause:
        return f"{cause} (writing to the run directory {run_dir.split('?', 1)[0]})"
    return cause


def root_cause(error: BaseException) -> str:
    """The first ``Failure`` in the error's chain (its causes, and Ray's wrapped ``cause``), else the
    innermost error's last line, without Ray's wrapping."""
    seen: set[int] = set()
    while id(error) not in seen:
        seen.add(id(error))
        wrapped = getattr(error, "cause", None)
        if isinstance(wrapped, BaseException):  # a RayTaskError: the process's own exception inside
            error = wrapped
            continue
        if isinstance(error, Failure):
            return _lines(error)[0] if _lines(error) else type(error).__name__
        if error.__cause__ is None:
            break
        error = error.__cause__
    lines = _lines(error)
    if not lines:
        return type(error).__name__
    # Ray Train hands back a worker's error as its traceback's text: a Failure's line is then
    # "ray_jobs.errors.Failure: <where>: <what>".
    return lines[-1].removeprefix(f"{Failure.__module__}.{Failure.__name__}: ")


def _lines(error: BaseException) -> list[str]:
    return [line for line in str(error).strip().splitlines() if line.strip()]


class PeerLost(RuntimeError):
    """A p2p send or receive failed: the peer stage died or timed out."""
