"""The pipeline case: the stage actors over schedules, micro-batch counts and transports, against the
sequential schedule and a single process; the bubble, where the stages' time goes, transfer cost."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from typing import Any

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.stats import (
    after_warmup,
    gpipe_bubble,
    ratio,
    sequential_critical_fraction,
    speedup_parts,
    stage_balance,
    steady,
    summarise,
    transfer_overhead_us,
)
from ray_jobs.bench.suites import OTHER_TRANSPORTS, PIPELINE_SCHEDULES, PIPELINE_TRANSPORT, LmWorkload, Workload
from ray_jobs.driver.prepare import prepare
from ray_jobs.pipeline.schedules import SCHEDULES

THREADS_PER_STAGE = 1  # each stage actor's CPUs and torch threads; also the single-process baseline's
# The measured shares of the stages' time (wall x S); the rest is reported as `other`.
TIME_SHARES = ("compute", "optimizer", "receive_wait", "p2p_calls")


def run_pipeline(
    bench: Bench,
    schedule: str,
    num_microbatches: int,
    transport: str,
    *,
    work: Workload | LmWorkload | None = None,
    data: str | None = None,
) -> dict[str, Any]:
    """One pipeline run of ``work`` on ``data`` (by default the suite's pipeline workload and data)."""
    from ray_jobs.pipeline import trainer as pipeline

    work, data = work or bench.suite.pipeline, data or bench.pipeline_data
    cfg = bench.config(work, data, f"pipe-{schedule}-{num_microbatches}-{transport}")
    scaling = pipeline.PipelineScaling(
        num_stages=bench.suite.num_stages,
        num_microbatches=num_microbatches,
        schedule=schedule,
        transport=transport,
        cpus_per_stage=float(THREADS_PER_STAGE),
    )
    prepared = prepare(cfg, "pipeline")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*the pipeline can never fill.*")
        summary = pipeline.run(prepared, scaling)
    bench.clean(prepared.run_dir)
    num_stages = bench.suite.num_stages
    timed = after_warmup(list(zip(summary.extra["epoch_seconds"], summary.extra["epoch_stage_time_fractions"])))
    step_s = [seconds / work.steps_per_epoch for seconds, _ in timed]
    result = {
        "samples_per_second": steady(summary.extra["epoch_seconds"], work.samples_per_epoch),
        "bubble_fraction": [f["bubble"] for _, f in timed],
        "transport": summary.extra["transport"],
        "step_s": step_s,
    }
    if schedule == "sequential":  # only there does no compute overlap, so the rest is transfer
        critical_s = [sequential_critical_fraction(f) * step for step, (_, f) in zip(step_s, timed)]
        result["critical_s"] = critical_s
        result["transfer_us"] = [
            transfer_overhead_us(step, critical, num_stages, num_microbatches)
            for step, critical in zip(step_s, critical_s)
        ]
    for key in TIME_SHARES:
        result[f"{key}_fraction"] = [f.get(key, 0.0) for _, f in timed]
    result["schedule_bubble"] = [f["schedule_bubble"] for _, f in timed]
    result["median_ops_bubble"] = [f["median_ops_bubble"] for _, f in timed]
    balance = [stage_balance(f) for _, f in timed]
    result["busiest_stage_bubble"] = [bubble for bubble, _ in balance]
    result["stage_imbalance"] = [imbalance for _, imbalance in balance]
    return result


def same_ops_as(schedule: str, num_stages: int, num_microbatches: int) -> str:
    """The first of ``PIPELINE_SCHEDULES`` with exactly the same per-stage op lists (at M=1 all
    three are F0 B0 on every stage): such configurations are one run, reported under each name."""
    ops = SCHEDULES[schedule](num_stages, num_microbatches)
    return next(s for s in PIPELINE_SCHEDULES if SCHEDULES[s](num_stages, num_microbatches) == ops)


def pipeline_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    suite, work = bench.suite, bench.suite.pipeline
    wanted = [(schedule, m, PIPELINE_TRANSPORT) for m in suite.microbatches for schedule in PIPELINE_SCHEDULES]
    wanted += [
        (schedule, m, transport)
        for m in suite.other_transport_microbatches
        for schedule in suite.other_transport_schedules
        for transport in OTHER_TRANSPORTS
    ]
    same_as = {c: same_ops_as(c[0], suite.num_stages, c[1]) for c in wanted}
    configs = [c for c in wanted if same_as[c] == c[0]]  # run each distinct op order once
    raw: dict[tuple, list[dict]] = {c: [] for c in configs}
    single: list[dict] = []
    if suite.warm_ups:
        bench.log("[bench] warm-up (discarded): one pipeline run, one single-process run")
        run_pipeline(bench, "gpipe", suite.target_microbatches, PIPELINE_TRANSPORT)
        bench.peer(work, bench.pipeline_data, 1, THREADS_PER_STAGE)
    for rep in range(max(suite.pipeline_repetitions, suite.pipeline_target_repetitions)):
        if rep < suite.cheap_repetitions:
            bench.measure(
                single,
                "single process, whole model",
                rep,
                lambda: bench.peer(work, bench.pipeline_data, 1, THREADS_PER_STAGE),
            )
        for config in configs:
            schedule, m, transport = config
            judged = m == suite.target_microbatches and transport == PIPELINE_TRANSPORT
            if rep >= (suite.pipeline_target_repetitions if judged else suite.pipeline_repetitions):
                continue
            bench.measure(
                raw[config],
                f"pipeline S={suite.num_stages} M={m} {schedule} {transport}",
                rep,
                lambda config=config: run_pipeline(bench, *config),
            )
    single_figures = summarise(single)
    figures_of = {config: summarise(runs, text=("transport",)) for config, runs in raw.items()}
    rows = []
    for schedule, m, transport in wanted:
        ran_as = same_as[(schedule, m, transport)]
        runs, figures = raw[(ran_as, m, transport)], figures_of[(ran_as, m, transport)]
        # the no-overlap baseline over the same transport, when that was run
        baseline = figures_of.get(("sequential", m, transport))
        row_bytes = (work.batch_size // m) * work.hidden * 4  # float32 activations at a cut
        rows.append(
            {
                "schedule": schedule,
                "num_microbatches": m,
                "transport_requested": transport,
                "same_ops_as": ran_as if ran_as != schedule else None,
                "transport": figures["transport"],
                "samples_per_second": figures["samples_per_second"],
                "speedup_vs_sequential": ratio(figures["samples_per_second"], baseline["samples_per_second"])
                if baseline
                else None,
                "speedup_vs_sequential_parts": speedup_parts(figures, baseline) if baseline else None,
                "speedup_vs_single_process": ratio(figures["samples_per_second"], single_figures["samples_per_second"]),
                "bubble_fraction": figures["bubble_fraction"],
                "bubble_theory": gpipe_bubble(suite.num_stages, m) if schedule != "sequential" else None,
                "bubble_schedule_median_ops": figures.get("median_ops_bubble"),
                "bubble_schedule_measured_ops": figures["schedule_bubble"],
                "bubble_busiest_stage": figures["busiest_stage_bubble"],
                "stage_imbalance": figures["stage_imbalance"],
                "transfer_us": figures.get("transfer_us"),  # measured for the sequential schedule only
                "step_s": figures["step_s"],
                "critical_s": figures.get("critical_s"),
                "bytes_per_transfer": row_bytes,
                "time_fractions": {key: figures.get(f"{key}_fraction") for key in TIME_SHARES},
                "raw": runs,
            }
        )
    transports = []
    for schedule in suite.other_transport_schedules:
        for m in suite.other_transport_microbatches:
            figures = {
                t: figures_of[(same_as[(schedule, m, t)], m, t)] for t in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)
            }
            main = figures[PIPELINE_TRANSPORT]["samples_per_second"]
            transports.append(
                {
                    "schedule": schedule,
                    "num_microbatches": m,
                    **{
                        t: {"samples_per_second": f["samples_per_second"], "bubble_fraction": f["bubble_fraction"]}
                        for t, f in figures.items()
                    },
                    **{
                        f"{PIPELINE_TRANSPORT}_over_{t}": ratio(main, figures[t]["samples_per_second"])
                        for t in OTHER_TRANSPORTS
                    },
                }
            )
    return {
        "workload": asdict(work),
        "num_stages": suite.num_stages,
        "threads_per_stage": THREADS_PER_STAGE,
        "single_process": {**single_figures, "num_threads": THREADS_PER_STAGE, "raw": single},
        "configs": rows,
        "transports": transports,
        "target_microbatches": suite.target_microbatches,
    }
