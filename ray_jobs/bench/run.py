"""Benchmarks: ``python -m ray_jobs.bench --suite quick|full [--out runs/bench] [--address ADDR]``, or
``--render DIR`` to write a finished run's report and plots anew from its ``bench.json``.

Measures raypar's strategies against plain PyTorch peers on the same model, data, global batch
and steps, and writes ``bench.json`` (every repetition), ``bench.md`` (the tables) and, when
matplotlib is installed, PNG plots into ``--out``. Every figure is the median of several
repetitions after a warm-up, with min and max: a throughput's repetitions are the epochs after
the first of each run (the first pays one-time costs), a start-up cost's are the runs. Every
comparison is a ratio of figures measured in the same bench run, the runs of both sides
interleaved.

Cases: DDP overhead (raypar vs torch.multiprocessing + gloo), DDP scaling, the actor pipeline
(schedules, micro-batches, transports, bubble, transfer cost), DataParallel vs DDP, data ingest,
pipeline stage memory, streaming ingest, gradient accumulation (``--grad-accum-steps`` 4 vs 1), a
language model (the built-in gpt in tokens/s: DDP vs the peer, ``--compile`` vs eager, the pipeline
vs its sequential schedule), FSDP vs DDP on the gpt across widths, the pretrained start, the 2-D
layouts, checkpoint stalls (sync vs async) and ``tokenize --ray``. The peers run at the niceness of
Ray's workers.
``--suite gpu`` (CUDA only; one ``error:`` line without it): DDP over 1..N GPUs vs the plain loop
and plain nccl DDP, DataParallel vs DDP, fp32 vs bf16, the pipeline over GPUs (``cases/gpu.py``),
and a GPT-2-small shape in bf16, tokens/s and MFU, ddp vs its peer and fsdp (``cases/gpu_lm.py``).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from ray_jobs.bench.cases import CASES, Bench, suite_cases
from ray_jobs.bench.plots import write_plots
from ray_jobs.bench.report import render
from ray_jobs.bench.stats import targets
from ray_jobs.bench.suites import SUITES, Suite
from ray_jobs.core.config import ADDRESS_HELP, ArgumentParser


def machine_info() -> dict[str, Any]:
    import ray

    return {
        "cpu_count": os.cpu_count(),
        "cluster_cpus": ray.cluster_resources().get("CPU"),
        "cluster_nodes": len([n for n in ray.nodes() if n.get("Alive")]),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads_default": torch.get_num_threads(),
        "load_average_at_start": _load_average(),
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }


def _load_average() -> list[float] | None:
    """1, 5 and 15-minute load: other work on the machine makes every figure noisier."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def run_suite(
    suite: Suite, out: str, storage_path: str, address: str | None, cases: Sequence[str] | None = None
) -> dict[str, Any]:
    """Run ``suite`` (``cases``, by default the suite's own) and write ``bench.json``, ``bench.md``
    and plots into ``out``."""
    cases = suite_cases(suite.name) if cases is None else cases
    from ray_jobs.driver.connect import connect

    began = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    connect(address)
    bench = Bench(suite, out, storage_path)
    results: dict[str, Any] = {
        "suite": suite.name,
        "settings": asdict(suite),
        "machine": {**machine_info(), "worker_niceness": bench.niceness},  # the peers' too
        "complete": False,
    }
    results["case_seconds"] = {}
    for name, case in CASES.items():
        if name in cases:
            case_began = time.perf_counter()
            results[name] = case(bench, results)
            results["case_seconds"][name] = time.perf_counter() - case_began
            _write_json(results, out)  # a later case failing keeps what was measured
    results["targets"] = targets(results)
    results["seconds"] = time.perf_counter() - began
    results["machine"]["load_average_at_end"] = _load_average()
    results["machine"]["steal_by_run"] = bench.steal
    results["complete"] = True
    _write_report(results, out)
    return results


def rerender(out: str) -> dict[str, Any]:
    """Write ``bench.md`` and the plots in ``out`` anew from its ``bench.json``, measuring
    nothing: for a run made without matplotlib, or after a change to the report."""
    path = os.path.join(out, "bench.json")
    try:
        with open(path) as handle:
            results = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--render {out}: cannot read {path}: {error}") from None
    if not results.get("complete"):
        raise ValueError(f"--render {out}: {path} is from a bench run that did not finish; run the bench again")
    _write_report(results, out)
    return results


def _write_report(results: dict[str, Any], out: str) -> None:
    results["plots"] = write_plots(results, out)
    _write_json(results, out)
    with open(os.path.join(out, "bench.md"), "w") as handle:
        handle.write(render(results))


def _write_json(results: dict[str, Any], out: str) -> None:
    path = os.path.join(out, "bench.json")
    with open(path + ".partial", "w") as handle:
        json.dump(results, handle, indent=2, default=str)
    os.replace(path + ".partial", path)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m ray_jobs.bench", description=__doc__)
    parser.add_argument(
        "--suite",
        default="quick",
        help="; ".join(f"{s.name}: {s.description}" for s in SUITES.values()) + " (default: quick)",
    )
    parser.add_argument("--out", default="runs/bench", help="output folder (default: runs/bench)")
    parser.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated subset of {', '.join(CASES)} (default: the suite's: "
        f"{', '.join(suite_cases('gpu'))} for --suite gpu, the others otherwise)",
    )
    parser.add_argument(
        "--storage-path",
        default=None,
        help="where the benchmarked runs write checkpoints; shared storage on a multi-node "
        "cluster (default: a temporary local folder, deleted at the end)",
    )
    parser.add_argument("--address", default=None, help=ADDRESS_HELP)
    parser.add_argument(
        "--render",
        metavar="DIR",
        default=None,
        help="measure nothing: write DIR/bench.md and the plots anew from DIR/bench.json "
        "(after installing matplotlib, or after a change to the report)",
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        return _rerender_main(args.render)
    if args.suite not in SUITES:
        parser.error(f"--suite {args.suite!r} is unknown; valid: {', '.join(SUITES)}")
    cases = suite_cases(args.suite) if args.cases is None else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        parser.error(f"--cases {args.cases!r}: valid cases are {', '.join(CASES)}")
    if (args.suite == "gpu" or set(cases) & set(suite_cases("gpu"))) and not torch.cuda.is_available():
        # Before Ray starts or any data is written: there is nothing to measure here.
        print(
            f"error: --suite gpu needs a CUDA GPU; this machine has none that torch {torch.__version__} can use "
            "(torch.cuda.is_available() is False)",
            file=sys.stderr,
        )
        return 2
    from ray_jobs.driver.connect import reachable

    try:
        reachable(args.address)  # a wrong address fails in seconds, before anything is written
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    scratch = None if args.storage_path else tempfile.mkdtemp(prefix="raypar-bench-")
    try:
        results = run_suite(SUITES[args.suite], args.out, args.storage_path or scratch, args.address, cases)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"interrupted; {os.path.join(args.out, 'bench.json')} holds the cases finished so far, if any",
            file=sys.stderr,
        )
        return 130
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    print(render(results))
    print(f"wrote {os.path.join(args.out, 'bench.json')} and bench.md")
    return 0


def _rerender_main(out: str) -> int:
    try:
        results = rerender(out)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    plots = results["plots"]  # the PNGs written, or why none were
    said = f"plots: {', '.join(plots)}" if isinstance(plots, list) else plots
    print(f"wrote {os.path.join(out, 'bench.md')}; {said}")
    return 0
