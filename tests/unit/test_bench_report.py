"""The bench's report (no Ray): tables, figures, and bench.md from bench.json."""

from __future__ import annotations

import json
import re

import pytest

from ray_jobs.bench.cases.lm import lm_figures
from ray_jobs.bench.report import fmt, markdown_table, render
from ray_jobs.bench.stats import ratio, stats, targets
from ray_jobs.bench.suites import SUITES
from tests.helpers import REPO


def test_markdown_table_aligns_numbers_right_and_text_left():
    table = markdown_table(["case", "samples/s"], [["ddp", "1,234"], ["torch", "987 (900–1,000)"]])
    assert table.splitlines() == [
        "| case  |       samples/s |",
        "|-------|----------------:|",
        "| ddp   |           1,234 |",
        "| torch | 987 (900–1,000) |",
    ]
    with pytest.raises(ValueError, match="2 columns"):
        markdown_table(["a", "b"], [["only one"]])


def test_markdown_table_treats_a_dash_as_a_missing_number():
    table = markdown_table(["ratio"], [["0.97"], ["-"]])
    assert table.splitlines()[1:] == ["|------:|", "|  0.97 |", "|     - |"]


def test_render_reports_each_target_met_missed_or_not_run():
    ingest = {
        "rows": 1000,
        "file_bytes": 2**20,
        "worker_rss_at_start_bytes": 100 * 2**20,
        "worker_peak_rss_bytes": 150 * 2**20,
        "pyarrow_rows_per_second": stats([2e6]),
        "raypar_rows_per_second": stats([1e6]),
        "raypar_over_pyarrow": ratio(stats([1e6]), stats([2e6])),
        "ddp_samples_per_second": stats([1e4]),
        "ingest_over_training": ratio(stats([1e6]), stats([1e4])),
    }
    results = {
        "suite": "quick",
        "seconds": 1.0,
        "ingest": ingest,
        "plots": "plots skipped: matplotlib not installed",
        "machine": {"cpu_count": 2, "torch": "t", "ray": "r", "python": "p", "platform": "x"},
    }
    results["targets"] = targets(results)
    text = render(results)
    assert re.search(r"\| ingest rows/s / DDP samples/s +\| >= 5x +\| +100.00 \| met +\|", text)
    # the DDP, pipeline, streaming, lm, sharding, pretrained and checkpoint cases did not run
    assert len(re.findall(r"\| not run +\|", text)) == 16
    assert "plots skipped: matplotlib not installed." in text
    assert "steal" not in text  # not measured: no claim either way


def test_render_names_the_run_the_hypervisor_slowed_most():
    machine = {
        "cpu_count": 2,
        "torch": "t",
        "ray": "r",
        "python": "p",
        "platform": "x",
        "steal_by_run": [
            {"run": "a, run 1", "steal_fraction": 0.01},
            {"run": "b, run 1", "steal_fraction": 0.085},
            {"run": "b, run 2", "steal_fraction": 0.02},
        ],
    }
    results = {"suite": "quick", "seconds": 1.0, "plots": "none", "machine": machine, "targets": []}
    assert "steal) during the measured runs: median 2.0%, most 8.5% (b, run 1)." in render(results)
    assert "; 1 s; load average" in render(results)  # a bench.json without each case's seconds
    results["case_seconds"] = {"data_parallel": 32.4, "pipeline": 21.5}
    assert "; 1 s (data_parallel 32 s, pipeline 22 s); load average" in render(results)


def test_render_puts_accumulation_k4_beside_k1():
    work = {"model": "mlp", "hidden": 8, "depth": 2, "in_features": 4, "out_features": 2, "rows": 64}
    runs = [
        {
            "grad_accum_steps": k,
            "samples_per_second": stats([sps]),
            "peak_rss_bytes": stats([rss * 2**20]),
            "saved_activation_peak_bytes": saved * 2**20,
        }
        for k, sps, rss, saved in ((1, 1000, 600, 100), (4, 900, 540, 25))
    ]
    accumulation = {
        "workload": {**work, "batch_size": 16, "epochs": 2},
        "num_workers": 2,
        "rows_per_worker": 8,
        "runs": runs,
        "samples_per_second_ratio": ratio(runs[1]["samples_per_second"], runs[0]["samples_per_second"]),
        "peak_rss_ratio": ratio(runs[1]["peak_rss_bytes"], runs[0]["peak_rss_bytes"]),
    }
    results = {"suite": "quick", "seconds": 1.0, "plots": "none", "accumulation": accumulation, "targets": []}
    results["machine"] = {"cpu_count": 2, "torch": "t", "ray": "r", "python": "p", "platform": "x"}
    text = render(results)
    assert "## 8. Gradient accumulation: K=4 against K=1 at one global batch" in text
    assert re.search(r"\| steady samples/s \(epoch loops only\) +\| +1,000 \| +900 \| +0.90 \|", text)
    assert re.search(r"\| peak RSS per worker \(the largest\), MiB +\| +600 \| +540 \| +0.90 \|", text)
    assert re.search(r"\| activations held for backward, .* MiB +\| +100.0 \| +25.0 \| +0.25 \|", text)


def test_render_puts_the_lm_case_in_tokens_per_second_beside_its_peers():
    work = SUITES["smoke"].lm  # T = 16
    pipe = {"bubble_fraction": [0.25]}
    raw = {
        "raypar": [{"samples_per_second": [98.0], "peak_rss_bytes": 500 * 2**20}],
        "torch": [{"samples_per_second": [100.0], "peak_rss_bytes": 400 * 2**20}],
        "single_process": [{"samples_per_second": [50.0]}],
        "sequential": [{"samples_per_second": [40.0], **pipe}],
        "gpipe": [{"samples_per_second": [80.0], **pipe}],
        "1f1b": [{"samples_per_second": [60.0], **pipe}],
        # --compile: the first epochs 30 s and 31 s longer than a steady one, eager's 1 s and 2 s.
        "raypar_compiled": [{"samples_per_second": [147.0], "first_epoch_excess_s": x} for x in (31.0, 31.0)],
    }
    raw["raypar"] = [{**raw["raypar"][0], "first_epoch_excess_s": x} for x in (1.0, 2.0)]
    results = {"suite": "quick", "seconds": 1.0, "plots": "none", "lm": lm_figures(raw, work, 2, 2, 4)}
    assert results["lm"]["compile"]["compile_seconds"] == stats([30.0, 29.0])
    results["machine"] = {"cpu_count": 2, "torch": "t", "ray": "r", "python": "p", "platform": "x"}
    results["targets"] = targets(results)
    text = render(results)
    assert "## 9. Language model: the gpt in tokens/s" in text
    assert re.search(r"\| steady tokens/s \(epoch loops only\) +\| +1,568 \| +1,600 \| +0.980 \|", text)
    assert re.search(r"\| gpipe +\| +1,280 \| +2.00 \| +1.60 \| +0.250 \| +0.200 \|", text)
    assert re.search(r"\| single process, whole gpt +\| +800 \|", text)
    assert (
        "raypar DDP at 2,352 steady tokens/s against 1,568 eager, **1.50x**; compiling took 29.5 (29.0–30.0) s" in text
    )
    assert re.search(r"\| lm gpt DDP 2 workers tokens/s, raypar / torch +\| >= 0.97x +\| +0.98 \| met +\|", text)
    assert re.search(r"\| lm gpt pipeline 1f1b S=2 M=4 / sequential tokens/s +\| >= 1.5x +\| +1.50 \| met +\|", text)


def test_fmt_shows_median_then_range_and_collapses_a_flat_range():
    assert fmt(stats([1000, 1200, 1100])) == "1,100 (1,000–1,200)"
    assert fmt(stats([0.5]), ".2f") == "0.50"
    assert fmt(stats([0.001, 0.002]), ".1f", 1e3) == "1.5 (1.0–2.0)"
    assert fmt(None) == "-"


def test_the_published_report_is_what_the_renderer_makes_of_its_json():
    # docs/bench is what the README quotes: its tables must come from its own figures.
    published = REPO / "docs" / "bench"
    results = json.loads((published / "bench.json").read_text())
    assert render(results) == (published / "bench.md").read_text()


def test_the_sharding_section_shows_each_workers_model_state_and_judges_fsdp_against_ddp():
    def held(total: int) -> dict:
        return {"parameters": total // 4, "gradients": total // 4, "optimizer": total // 2, "total": total}

    gpt = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64, "batch_size": 4}
    work = {"model": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "rows": 64}
    speeds = {"ddp": stats([1000.0, 1100.0]), "fsdp": stats([900.0, 950.0])}
    width = {"n_embd": 32, "parameters": 30_000, "samples_per_second": speeds, "model_state_ratio": 0.5}
    case = {
        "workload": {**work, "batch_size": 16, "epochs": 2, "optimizer": "adamw", "lr": 1e-3},
        "widths": [{**width, "samples_per_second_ratio": ratio(speeds["fsdp"], speeds["ddp"])}],
        "num_workers": 2,
        "model_state_bytes": {"ddp": [held(4096), held(4096)], "fsdp": [held(2048), held(2048)]},
        "model_state_ratio": 0.5,
        "samples_per_second": {"ddp": stats([1000.0, 1100.0]), "fsdp": stats([900.0, 950.0])},
        "samples_per_second_ratio": ratio(stats([900.0, 950.0]), stats([1000.0, 1100.0])),
        "activations": {
            "gpt": gpt,
            "parameter_bytes": 2**20,
            "plain": {"saved_bytes": 8 * 2**20, "step_seconds": stats([0.02])},
            "checkpointed": {"saved_bytes": 2**20, "step_seconds": stats([0.03])},
            "saved_ratio": 0.125,
            "step_time_ratio": ratio(stats([0.03]), stats([0.02])),
        },
    }
    machine = {"cpu_count": 2, "torch": "t", "ray": "r", "python": "p", "platform": "x"}
    results = {"suite": "quick", "seconds": 1.0, "plots": "none", "machine": machine, "sharding": case}
    results["targets"] = targets(results)
    text = render(results)
    assert "| fsdp     |          1 |             0.5 |            0.5 |            1.0 |        2.0 |" in text
    assert re.search(r"\| FSDP model state per worker / DDP's +\| <= 1.1/N \(0.550\) +\| +0.50 \| met +\|", text)
    assert re.search(r"\| FSDP samples/s / DDP's +\| >= 0.8x +\| .* \| met +\|", text)
    assert "Checkpointing holds 0.125 of the activations" in text
    assert re.search(
        r"\| +32 \| +30,000 \| 1,050 \(1,000–1,100\) \| +925 \(900–950\) \| 0.88 \(0.82–0.95\) \| +0.500 \|", text
    )


def test_the_layouts_section_puts_every_layout_beside_ddp():
    from ray_jobs.bench.report_layouts import layouts_section

    def figure(value: float) -> dict:
        return {"median": value, "min": value, "max": value}

    speeds = {"ddp": 1000.0, "hsdp": 800.0, "pipeline": 500.0, "dp_x_pp": 700.0, "fsdp_x_pp": 600.0}
    case = {
        "workload": {"n_layer": 2, "n_embd": 32, "block_size": 16, "batch_size": 16},
        "processes": 4,
        "num_microbatches": 4,
        "tokens_per_second": {layout: figure(value) for layout, value in speeds.items()},
        "over_ddp": {layout: figure(value / 1000) for layout, value in speeds.items()},
        "comm_bytes_per_step": {
            "ddp": {"model": {"all_reduce": 2048.0, "send": 0.0}, "measured": {"all_reduce": 2048.0, "send": 0.0}}
        },
        "comm_agreement": 0.0,
    }
    text = "\n".join(layouts_section(case))
    assert "| DDP, 4 workers | all-reduce |       2,048 |         2,048 |" in text and "worst gap 0.00%" in text
    assert "| send" not in text  # a call neither side made
    assert "| DP x PP, 2 replicas x 2 stages" in text and "0.70" in text and "measure each layout's overhead" in text
