"""The bench's report, ``bench.md``: the machine, one section per case (each from its own
``report_<case>.py``), then the targets."""

from __future__ import annotations

import statistics
from typing import Any

from ray_jobs.bench.report_accumulation import accumulation_section
from ray_jobs.bench.report_checkpoint import checkpoint_section
from ray_jobs.bench.report_comm_model import comm_model_section
from ray_jobs.bench.report_data_parallel import ddp_sections, dp_vs_ddp_section
from ray_jobs.bench.report_gpu import gpu_sections
from ray_jobs.bench.report_ingest import ingest_section
from ray_jobs.bench.report_layouts import layouts_section
from ray_jobs.bench.report_lm import lm_section
from ray_jobs.bench.report_pipeline import pipeline_section
from ray_jobs.bench.report_pretrained import pretrained_section
from ray_jobs.bench.report_sharding import sharding_section
from ray_jobs.bench.report_stage_memory import stage_memory_section
from ray_jobs.bench.report_stream_ingest import stream_ingest_section
from ray_jobs.bench.report_tables import fmt, markdown_table
from ray_jobs.bench.report_tokenize import tokenize_section

__all__ = ["fmt", "markdown_table", "render"]  # the table helpers, for callers that know them from here


def render(results: dict[str, Any]) -> str:
    """The Markdown report: one table per case, then the targets."""
    return (
        "\n".join(
            _header(results)
            + ddp_sections(results.get("data_parallel"))
            + pipeline_section(results.get("pipeline"))
            + dp_vs_ddp_section(results.get("data_parallel"))  # in the order, after the pipeline
            + ingest_section(results.get("ingest"))
            + stage_memory_section(results.get("stage_memory"))
            + stream_ingest_section(results.get("stream_ingest"))
            + accumulation_section(results.get("accumulation"))
            + lm_section(results.get("lm"))
            + sharding_section(results.get("sharding"))
            + pretrained_section(results.get("pretrained"))
            + layouts_section(results.get("layouts"))
            + checkpoint_section(results.get("checkpoint"))
            + tokenize_section(results.get("tokenize"))
            + comm_model_section(results.get("comm_model"))
            + gpu_sections(results)
            + _targets(results)
        )
        + "\n"
    )


def _header(results: dict[str, Any]) -> list[str]:
    machine = results["machine"]
    return [
        f"# raypar bench: suite `{results['suite']}`",
        "",
        f"{machine['cpu_count']} CPUs, {_gpus(machine)}torch {machine['torch']}, ray {machine['ray']}, "
        f"python {machine['python']}, "
        f"{machine['platform']}; {results['seconds']:.0f} s{_case_seconds(results.get('case_seconds'))}; "
        "load average (1/5/15 min) "
        f"{machine.get('load_average_at_start')} at start, {machine.get('load_average_at_end')} at end. "
        f"{_steal_line(machine.get('steal_by_run'))}"
        f"{_niceness_line(machine.get('worker_niceness'))}"
        "Figures: median (min–max) of the repetitions after a warm-up (throughput: every epoch after each "
        "run's first; start-up: the runs); ratios: ratio of medians (least–most favourable pairing).",
    ]


def _case_seconds(seconds: dict[str, float] | None) -> str:
    """Each case's share of the run's time (bench.json files written before it lack them)."""
    if not seconds:
        return ""
    return " (" + ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items()) + ")"


def _targets(results: dict[str, Any]) -> list[str]:
    on = "GPU, nccl" if results["suite"] == "gpu" else "CPU, gloo"
    return [
        "",
        f"## Targets (this machine: {on}; reported, not asserted)",
        "",
        markdown_table(
            ["target", "goal", "measured", "target"],
            [
                [
                    t["name"],
                    t["goal"],
                    fmt(t["measured"], "+.3f" if t.get("unit") == "points" else ".2f") if t["measured"] else "-",
                    t["status"],
                ]
                for t in results["targets"]
            ],
        ),
        "",
        "A target is `met` or `missed` when the median and both ends of its range agree; `within noise` "
        "when the range (least–most favourable pairing) reaches across the goal: more repetitions or a "
        "quieter machine decide it.",
        "",
        f"Plots: {', '.join(results['plots']) or 'none for these cases'}."
        if isinstance(results["plots"], list)
        else f"{results['plots']}.",
    ]


def _gpus(machine: dict[str, Any]) -> str:
    gpus = machine.get("gpus")  # absent from reports before the GPU suite
    return f"{len(gpus)} GPU ({', '.join(sorted(set(gpus)))}, CUDA {machine.get('cuda')}), " if gpus else ""


def _niceness_line(niceness: int | None) -> str:
    if niceness is None:  # a report from before the peers matched it
        return ""
    return f"Ray's workers and the plain-torch peers ran at nice {niceness}. "


def _steal_line(runs: list[dict[str, Any]] | None) -> str:
    if not runs:
        return ""
    worst = max(runs, key=lambda r: r["steal_fraction"])
    median = statistics.median(r["steal_fraction"] for r in runs)
    return (
        f"CPU time taken by the hypervisor (steal) during the measured runs: median {median:.1%}, "
        f"most {worst['steal_fraction']:.1%} ({worst['run']}). "
    )
