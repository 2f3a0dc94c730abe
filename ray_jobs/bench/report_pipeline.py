"""bench.md's section for the pipeline case: its schedules and transports, where the stages' time
goes, and what a transfer costs."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.cases.pipeline import TIME_SHARES
from ray_jobs.bench.report_tables import fmt, markdown_table, workload_line
from ray_jobs.bench.suites import OTHER_TRANSPORTS, PIPELINE_TRANSPORT


def pipeline_section(pipe: dict[str, Any] | None) -> list[str]:
    """Section 3."""
    if not pipe:
        return []
    return _schedules(pipe) + _time_shares_table(pipe) + _transfers(pipe) + _transports(pipe)


def _schedules(pipe: dict[str, Any]) -> list[str]:
    single = pipe["single_process"]
    return [
        "",
        f"## 3. Pipeline: {pipe['num_stages']} stage actors",
        "",
        f"{workload_line(pipe['workload'])}; {pipe['threads_per_stage']} CPU and torch thread per stage. "
        f"Single process (plain torch loop, whole model, {single['num_threads']} thread): "
        f"{fmt(single['samples_per_second'])} samples/s. Bubble: share of the stages' time (wall x S) "
        "spent neither in forward/backward nor in the optimizer step (which every schedule runs once "
        "per batch, outside the fill and drain the theory counts); waiting, transfers and dispatch are "
        "bubble. Theory: GPipe (S-1)/(M+S-1), equal stages and free transfers. "
        "`(= sequential)`: the same op order on every stage, so one run reported under both names. "
        "`vs sequential` = `busy share` x `op speed` (medians, so nearly): the stages' busy share "
        "(1 - bubble) over the sequential runs' is what the schedule overlaps; samples per second "
        "of busy stage time over theirs is how fast the ops ran, which two stages computing at "
        "once, or a slow phase of the host, lowers whatever the schedule.",
        "",
        markdown_table(
            [
                "M",
                "schedule",
                "transport",
                "samples/s",
                "vs sequential",
                "busy share",
                "op speed",
                "vs single process",
                "bubble",
                "bubble theory",
            ],
            [
                [
                    r["num_microbatches"],
                    r["schedule"] + (f" (= {r['same_ops_as']})" if r["same_ops_as"] else ""),
                    r["transport"],
                    fmt(r["samples_per_second"]),
                    fmt(r["speedup_vs_sequential"], ".2f"),
                    *_speedup_parts_cells(r),
                    fmt(r["speedup_vs_single_process"], ".2f"),
                    fmt(r["bubble_fraction"], ".3f"),
                    f"{r['bubble_theory']:.3f}" if r["bubble_theory"] is not None else "-",
                ]
                for r in pipe["configs"]
            ],
        ),
    ]


def _time_shares_table(pipe: dict[str, Any]) -> list[str]:
    return [
        "",
        f"### Where the stages' time goes (M={pipe['target_microbatches']})",
        "",
        "Shares of wall x S; `p2p calls`: gloo's send, receive-post and send-wait calls (p2p only); "
        "`other`: dispatch and Python between ops (and, for "
        "transports other than p2p, waiting, which only p2p measures apart). `schedule, measured "
        "ops`: the bubble of the schedule replayed with every op's and optimizer step's measured "
        "duration and instant transfers; `schedule, median ops`: the same with each stage's "
        "forwards, backwards and steps each at that stage's median. So theory to median ops is "
        "the cut (uneven stages, the optimizer steps); median to measured ops is the jitter of "
        "single ops (a slow op holds up the stage waiting for it); measured ops to the bubble is "
        "raypar's own cost (transfers, wake-ups, dispatch). `busiest stage`: "
        "the idle share of the stage with the most compute and optimizer time, which sets the pace; "
        "`imbalance`: that time over the least busy stage's. The gap between the bubble and the busiest stage's "
        "is the other stages idling because the cut is uneven.",
        "",
        markdown_table(
            [
                "schedule",
                "transport",
                "compute",
                "optimizer",
                "receive wait",
                "p2p calls",
                "other",
                "bubble",
                "theory, equal stages",
                "schedule, median ops",
                "schedule, measured ops",
                "busiest stage",
                "imbalance",
            ],
            [
                [
                    r["schedule"],
                    r["transport"],
                    *_time_shares(r),
                    fmt(r["bubble_fraction"], ".3f"),
                    f"{r['bubble_theory']:.3f}" if r["bubble_theory"] is not None else "-",
                    fmt(r.get("bubble_schedule_median_ops"), ".3f"),
                    fmt(r["bubble_schedule_measured_ops"], ".3f"),
                    fmt(r.get("bubble_busiest_stage"), ".3f"),
                    fmt(r.get("stage_imbalance"), ".2f"),
                ]
                for r in pipe["configs"]
                if r["num_microbatches"] == pipe["target_microbatches"] and not r["same_ops_as"]
            ],
        ),
    ]


def _transfers(pipe: dict[str, Any]) -> list[str]:
    return [
        "",
        "### Transfer cost per micro-batch (sequential schedule: no compute overlaps)",
        "",
        "µs per transfer = (step time - critical path) / (2 (S-1) M), the critical path being every "
        "stage's forward and backward plus the first stage's optimizer step (each later stage steps "
        "while the gradient travels upstream); an upper bound, since the uncovered time also holds "
        "the driver's dispatch. "
        "Bytes = micro-batch rows x width x 4.",
        "",
        markdown_table(
            [
                "M",
                "micro-batch rows",
                "bytes per transfer",
                "transport",
                "step ms",
                "critical path ms",
                "µs per transfer",
            ],
            [
                [
                    r["num_microbatches"],
                    pipe["workload"]["batch_size"] // r["num_microbatches"],
                    f"{r['bytes_per_transfer']:,}",
                    r["transport"],
                    fmt(r["step_s"], ".1f", 1e3),
                    fmt(r["critical_s"], ".1f", 1e3),
                    fmt(r["transfer_us"], ",.0f"),
                ]
                for r in pipe["configs"]
                if r["schedule"] == "sequential"
            ],
        ),
    ]


def _transports(pipe: dict[str, Any]) -> list[str]:
    if not pipe["transports"]:
        return []
    return [
        "",
        "### Transports",
        "",
        f"`{PIPELINE_TRANSPORT}` (the default): torch.distributed send/recv between the stage actors, one "
        "actor call per stage per few batches (`--batches-per-call`); "
        "`compiled`: a Ray Compiled Graph, one node per op; "
        "`actor_calls`: one Ray actor call per op, activations as object references.",
        "",
        markdown_table(
            [
                "schedule",
                "M",
                *[f"{t} samples/s" for t in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
                *[f"{PIPELINE_TRANSPORT} / {t}" for t in OTHER_TRANSPORTS],
                *[f"{t} bubble" for t in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
            ],
            [
                [
                    t["schedule"],
                    t["num_microbatches"],
                    *[fmt(t[k]["samples_per_second"]) for k in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
                    *[fmt(t[f"{PIPELINE_TRANSPORT}_over_{k}"], ".2f") for k in OTHER_TRANSPORTS],
                    *[fmt(t[k]["bubble_fraction"], ".3f") for k in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
                ]
                for t in pipe["transports"]
            ],
        ),
    ]


def _speedup_parts_cells(row: dict) -> list[str]:
    """The split computed when the row was measured; ``-`` without a baseline, or in a report
    that predates it."""
    parts = row.get("speedup_vs_sequential_parts")
    return [fmt(parts[k], ".2f") for k in ("busy_share", "op_speed")] if parts else ["-", "-"]


def _time_shares(row: dict) -> list[str]:
    """The measured shares, ``-`` for one a report predates, and the rest as ``other``."""
    known = [row["time_fractions"].get(k) for k in TIME_SHARES]
    medians = [share["median"] for share in known if share]
    return [*(f"{share['median']:.3f}" if share else "-" for share in known), f"{1.0 - sum(medians):.3f}"]
