"""The bench's PNG plots, drawn when matplotlib (the ``bench`` extra) is installed."""

from __future__ import annotations

import os
from typing import Any

from ray_jobs.bench.stats import gpipe_bubble
from ray_jobs.bench.suites import PIPELINE_TRANSPORT


def write_plots(results: dict[str, Any], out: str) -> list[str] | str:
    """PNG plots when matplotlib is installed; otherwise why they were skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plots skipped: matplotlib not installed"
    written = []

    def save(figure, name: str) -> None:
        path = os.path.join(out, name)
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(name)

    def errors(figures: list[dict]) -> list[list[float]]:
        return [[f["median"] - f["min"] for f in figures], [f["max"] - f["median"] for f in figures]]

    data_parallel = results.get("data_parallel")
    if data_parallel:
        points = data_parallel["scaling"]["points"]
        counts = [p["num_workers"] for p in points]
        figures = [p["samples_per_second"] for p in points]
        figure, axis = plt.subplots(figsize=(5, 4))
        axis.errorbar(
            counts, [f["median"] for f in figures], yerr=errors(figures), marker="o", capsize=3, label="raypar DDP"
        )
        axis.set_xticks(counts)
        if counts and counts[0] == 1:
            axis.plot(counts, [figures[0]["median"] * n for n in counts], "--", color="grey", label="linear")
        axis.set(xlabel="workers", ylabel="samples/s", title="DDP scaling")
        axis.legend()
        save(figure, "scaling.png")

        overhead = data_parallel["ddp_overhead"]
        figure, axes = plt.subplots(1, 2, figsize=(8, 4))
        for axis, key, label in (
            (axes[0], "samples_per_second", "steady samples/s"),
            (axes[1], "startup_s", "wall - loop time, s"),
        ):
            pair = [overhead["raypar"][key], overhead["torch"][key]]
            axis.bar(["raypar", "torch"], [f["median"] for f in pair], yerr=errors(pair), capsize=4)
            axis.set(title=label)
        save(figure, "ddp_overhead.png")

    pipe = results.get("pipeline")
    if pipe:
        swept = [r for r in pipe["configs"] if r["transport_requested"] == PIPELINE_TRANSPORT]
        figure, axes = plt.subplots(1, 2, figsize=(10, 4))
        for schedule in ("gpipe", "1f1b", "sequential"):
            rows = [r for r in swept if r["schedule"] == schedule]
            ms = [r["num_microbatches"] for r in rows]
            figures = [r["samples_per_second"] for r in rows]
            axes[0].errorbar(
                ms, [f["median"] for f in figures], yerr=errors(figures), marker="o", capsize=3, label=schedule
            )
            if schedule != "sequential":
                bubbles = [r["bubble_fraction"] for r in rows]
                axes[1].errorbar(
                    ms,
                    [f["median"] for f in bubbles],
                    yerr=errors(bubbles),
                    marker="o",
                    capsize=3,
                    label=f"{schedule} measured",
                )
        axes[0].axhline(
            pipe["single_process"]["samples_per_second"]["median"], ls="--", color="grey", label="single process"
        )
        ms = sorted({r["num_microbatches"] for r in swept})
        axes[1].plot(ms, [gpipe_bubble(pipe["num_stages"], m) for m in ms], "k--", label="GPipe theory")
        for axis in axes:
            axis.set_xscale("log", base=2)
            axis.set_xticks(ms, [str(m) for m in ms])
            axis.set_xlabel("micro-batches M")
            axis.legend()
        axes[0].set(ylabel="samples/s", title="pipeline throughput")
        axes[1].set(ylabel="bubble fraction", title="pipeline bubble")
        save(figure, "pipeline.png")

        sequential = [r for r in pipe["configs"] if r["schedule"] == "sequential"]
        figure, axis = plt.subplots(figsize=(5, 4))
        for transport in sorted({r["transport"] for r in sequential}):
            rows = [r for r in sequential if r["transport"] == transport]
            figures = [r["transfer_us"] for r in rows]
            axis.errorbar(
                [r["bytes_per_transfer"] for r in rows],
                [f["median"] for f in figures],
                yerr=errors(figures),
                marker="o",
                capsize=3,
                label=transport,
            )
        axis.set_xscale("log", base=2)
        sizes = sorted({r["bytes_per_transfer"] for r in sequential})
        axis.set_xticks(sizes, [f"{b // 1024:,} KiB" if b >= 1024 else f"{b} B" for b in sizes])
        axis.set(xlabel="bytes per transfer", ylabel="µs per transfer (upper bound)", title="transfer cost")
        axis.legend()
        save(figure, "transfer.png")
    return written
