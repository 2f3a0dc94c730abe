"""bench.md's sections for the data_parallel case: DDP's overhead beside the torch peer, its
scaling, and DataParallel beside DDP."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import MIB, fmt, markdown_table, workload_line
from ray_jobs.bench.stats import QUIET_STEAL


def ddp_sections(case: dict[str, Any] | None) -> list[str]:
    """Sections 1 (overhead) and 2 (scaling)."""
    if not case:
        return []
    work = case["workload"]
    overhead = case["ddp_overhead"]
    return [
        "",
        f"## 1. DDP overhead: raypar vs torch.multiprocessing.spawn + gloo, {overhead['num_workers']} workers",
        "",
        f"{workload_line(work)}; 1 CPU and 1 torch thread per worker; "
        f"{len(overhead['raw']['raypar'])} raypar / {len(overhead['raw']['torch'])} torch repetitions.",
        "",
        markdown_table(
            ["measure", "raypar DDP (Ray Train)", "torch DDP (spawn, gloo)", "raypar / torch"],
            _overhead_rows(overhead),
        ),
        "",
        "## 2. DDP scaling",
        "",
        f"{workload_line(work)}; the cluster has {case['scaling']['cluster_cpus']} CPUs; "
        "efficiency = samples/s(N) / (N x samples/s(1)).",
        "",
        markdown_table(
            ["workers", "samples/s", "speed-up vs 1", "efficiency"],
            [
                [
                    p["num_workers"],
                    fmt(p["samples_per_second"]),
                    fmt(p["speedup"], ".2f"),
                    fmt(p["efficiency"], ".2f"),
                ]
                for p in case["scaling"]["points"]
            ],
        ),
    ]


def _overhead_rows(overhead: dict[str, Any]) -> list[list[str]]:
    raypar, peer = overhead["raypar"], overhead["torch"]
    return [
        [
            "steady samples/s (epoch loops only)",
            fmt(raypar["samples_per_second"]),
            fmt(peer["samples_per_second"]),
            fmt(overhead["samples_per_second_ratio"], ".3f"),
        ],
        [
            f"the same, epochs with <= {QUIET_STEAL:.0%} CPU steal only",
            _quiet_cell(raypar),
            _quiet_cell(peer),
            fmt(overhead.get("quiet_samples_per_second_ratio"), ".3f"),
        ],
        [
            "fixed cost, s: wall - loop time (start-up, final checkpoint, teardown)",
            fmt(raypar["startup_s"], ".1f"),
            fmt(peer["startup_s"], ".1f"),
            fmt(overhead["startup_ratio"], ".1f"),
        ],
        [
            "start-up, s: job start to first step",
            fmt(raypar.get("first_step_s"), ".2f"),
            fmt(peer["first_step_s"], ".2f"),
            fmt(overhead.get("first_step_ratio"), ".1f"),
        ],
        [
            "the rest, s: wall - start-up - loop (between epochs, final checkpoint, teardown)",
            fmt(raypar.get("after_loop_s"), ".2f"),
            fmt(peer.get("after_loop_s"), ".2f"),
            "-",
        ],
        ["total wall, s", fmt(raypar["wall_s"], ".1f"), fmt(peer["wall_s"], ".1f"), "-"],
        [
            "peak RSS per worker (the largest), MiB",
            fmt(raypar.get("peak_rss_bytes"), ".0f", 1 / MIB),
            fmt(peer["peak_rss_bytes"], ".0f", 1 / MIB),
            fmt(overhead.get("peak_rss_ratio"), ".2f"),
        ],
        [
            "CPU steal by the hypervisor, share of each run",
            fmt(raypar.get("steal_fraction"), ".1%"),
            fmt(peer.get("steal_fraction"), ".1%"),
            "-",
        ],
    ]


def _quiet_cell(figures: dict[str, Any]) -> str:
    quiet_figure = figures.get("samples_per_second_quiet")
    return f"{fmt(quiet_figure)}, {len(quiet_figure['values'])} epochs" if quiet_figure else "no quiet epoch"


def dp_vs_ddp_section(case: dict[str, Any] | None) -> list[str]:
    """Section 4, printed after the pipeline's section 3: the issue's order."""
    if not case:
        return []
    n = case["ddp_overhead"]["num_workers"]
    dp_vs_ddp = case["dp_vs_ddp"]
    section = ["", f"## 4. DataParallel vs DDP on one node ({n} CPUs each)", ""]
    if "skipped" in dp_vs_ddp:
        return section + [f"Skipped: {dp_vs_ddp['skipped']}."]
    return section + [
        f"DataParallel: one worker holding {n} CPUs ({n} torch threads; `nn.DataParallel` only splits "
        f"over GPUs, so on CPU it is the plain model); DDP: {n} workers x 1 CPU.",
        "",
        markdown_table(
            ["strategy", "samples/s", "DDP / DataParallel"],
            [
                ["DDP", fmt(dp_vs_ddp["ddp"]["samples_per_second"]), fmt(dp_vs_ddp["ddp_over_dp"], ".2f")],
                ["DataParallel", fmt(dp_vs_ddp["dp"]["samples_per_second"]), "-"],
            ],
        ),
    ]
