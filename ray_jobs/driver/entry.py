"""The shape every entry point shares: parse flags, validate, connect, run, print.

User errors found before training end as one ``error:`` line and exit status 2; a run that fails
as one line naming its root cause and 1; a finished run re-run with its own settings says so, 0.
"""

from __future__ import annotations

import os
import sys
import typing
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayError

from ray_jobs.core.config import ADDRESS_HELP, ArgumentParser, TrainConfig, add_flags, flag_group, from_args
from ray_jobs.driver.connect import end_local_ray_now, join, ray_started_here, reachable
from ray_jobs.driver.interrupts import run_until_interrupted, stop_requested
from ray_jobs.driver.lease import RunLease
from ray_jobs.driver.prepare import PreparedRun, prepare
from ray_jobs.driver.rerun import AlreadyComplete
from ray_jobs.driver.summary import TrainSummary
from ray_jobs.errors import TrainingFailed, os_error_line, root_cause


def entry_point(
    strategy: str,
    scaling_cls: type,
    run: Callable[[PreparedRun, Any], TrainSummary],
    argv: list[str] | None,
    description: str | None,
) -> int:
    parser = ArgumentParser(prog=f"python -m ray_jobs.{strategy}", description=description)
    add_flags(parser, TrainConfig)
    add_flags(parser, scaling_cls, "placement")
    flag_group(parser, "placement").add_argument("--address", default=None, help=ADDRESS_HELP)
    args = parser.parse_args(argv)
    lease = RunLease()  # held until the run ends, however it ends: released last, below
    try:
        cfg, scaling = from_args(TrainConfig, args), from_args(scaling_cls, args)
        scaling.check(cfg)
        target = reachable(args.address)  # a wrong address fails in seconds, before the data is read
        prepared = prepare(cfg, strategy, claim=lease.acquire)
        if hasattr(scaling, "check_model"):  # what needs the data's widths (a user's model), still before Ray
            scaling.check_model(prepared)
        join(target, args.address)
        # After connecting, since Ray's core installs its own SIGTERM handler: SIGTERM (ray job
        # stop, kill, a scheduler) then ends the run like Ctrl-C.
        summary = run_until_interrupted(lambda: run(prepared, scaling))
    except AlreadyComplete as done:
        print(done)
        return 0
    except TrainingFailed as error:
        print(f"error: training failed: {error}", file=sys.stderr)
        return 1
    except RayError as error:  # before ValueError: Ray re-raises a task's ValueError as one
        print(f"error: training failed: {root_cause(error)}", file=sys.stderr)
        return 1
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # the storage, the data or a user's module could not be read or written
        print(f"error: {os_error_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "interrupted: stopping the run's workers; the latest checkpoint is kept and "
            "a re-run with the same --name resumes",
            file=sys.stderr,
            flush=True,
        )
        return 130  # exit_process ends the run's actors with this process (its docstring says how)
    finally:
        lease.release()
    print(summary.table())
    return 0


def exit_process(code: int) -> typing.NoReturn:
    """End an entry point's process: flush, disconnect from Ray, and exit without finalizing the
    interpreter.

    After Ctrl-C or SIGTERM, a helper thread can still be inside a Ray call: the fit's ``ray.get``
    on Ray Train's controller, which raypar holds no handle to cancel. Tearing Ray's core worker
    down under that call crashed the process (SIGSEGV in ``CoreWorkerMemoryStore::Get``, exit -11
    for 130, in one CI run), and so did finalizing the interpreter (once in ~20 runs). So a
    stopped run's process ends at once, without either. Ray then ends every actor this driver
    owned (the Train controller, whose workers go with it, or the pipeline's stages), as it does
    when a driver disconnects. A local Ray started here is killed with the process (Ray starts its
    daemons fate-sharing), and ``end_local_ray_now`` kills what they started first."""
    sys.stdout.flush()
    sys.stderr.flush()
    if ray.is_initialized():
        if not stop_requested():
            ray.shutdown()
        elif ray_started_here():
            end_local_ray_now()
    os._exit(code)
