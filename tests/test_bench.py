"""The bench's own parts (no Ray): statistics, theory, tables, the plain-torch peer; and one
end-to-end run of the smoke suite on the shared cluster."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from ray_jobs.bench import (
    SUITES,
    fmt,
    gpipe_bubble,
    main,
    markdown_table,
    quiet,
    quiet_ratio,
    ratio,
    render,
    run_suite,
    same_ops_as,
    sequential_critical_fraction,
    speedup_parts,
    stage_balance,
    stats,
    steady,
    summarise,
    target,
    targets,
    torch_ddp,
    transfer_overhead_us,
    worker_counts,
)
from models import build_model
from ray_jobs.config import TrainConfig
from ray_jobs.data import read_dataset
from ray_jobs.readings import cpu_times, steal_fraction
from tests.helpers import REPO, assert_same_weights, reference_for


def test_stats_median_min_max():
    assert stats([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "values": [3.0, 1.0, 2.0]}
    assert stats([4, 1, 2, 3])["median"] == 2.5  # even count: mean of the middle two
    assert stats([7])["min"] == stats([7])["max"] == 7.0
    with pytest.raises(ValueError, match="no repetitions"):
        stats([])


def test_ratio_takes_medians_and_extreme_pairings():
    got = ratio(stats([90, 100, 110]), stats([40, 50, 55]))
    assert got == pytest.approx({"median": 2.0, "min": 90 / 55, "max": 110 / 40})


def test_steady_throughput_drops_each_runs_first_epoch():
    assert steady([9.0, 2.0, 4.0], 100) == [50.0, 25.0]  # the 9 s first epoch is warm-up
    assert steady([4.0], 100) == [25.0]  # a single epoch is all there is


def test_summarise_pools_every_timed_epoch_of_every_run():
    runs = [{"samples_per_second": [1.0, 5.0], "wall_s": 10.0, "transport": "p2p_gloo"},
            {"samples_per_second": [3.0], "wall_s": 12.0, "transport": "p2p_gloo"}]
    figures = summarise(runs, text=("transport",))
    assert figures["samples_per_second"] == stats([1.0, 5.0, 3.0])
    assert figures["wall_s"]["median"] == 11.0 and figures["transport"] == "p2p_gloo"


def test_summarise_leaves_out_what_a_run_did_not_measure():
    runs = [{"wall_s": 10.0, "steal_fraction": None, "off_linux": None},
            {"wall_s": 12.0, "steal_fraction": 0.1}, {"wall_s": 14.0, "steal_fraction": 0.3}]
    figures = summarise(runs)
    assert figures["steal_fraction"] == stats([0.1, 0.3]) and "off_linux" not in figures


def test_gpipe_bubble_theory():
    assert gpipe_bubble(2, 8) == pytest.approx(1 / 9)
    assert gpipe_bubble(4, 4) == pytest.approx(3 / 7)
    assert gpipe_bubble(1, 16) == 0.0  # one stage never waits
    assert gpipe_bubble(2, 1) == pytest.approx(1 / 2)  # one micro-batch: each stage idles half the time
    with pytest.raises(ValueError):
        gpipe_bubble(0, 4)


def test_schedules_with_the_same_op_order_run_once():
    assert {same_ops_as(s, 2, 1) for s in ("gpipe", "1f1b", "sequential")} == {"sequential"}  # F0 B0 everywhere
    assert [same_ops_as(s, 2, 8) for s in ("gpipe", "1f1b", "sequential")] == ["gpipe", "1f1b", "sequential"]
    assert same_ops_as("1f1b", 1, 4) == "sequential"  # one stage: 1F1B alternates from the start


def test_transfer_overhead_per_transfer():
    # 10 ms step, 6 ms computing, S=2, M=4: 8 transfers share 4 ms.
    assert transfer_overhead_us(0.010, 0.006, 2, 4) == pytest.approx(500.0)


def test_sequential_critical_path_counts_only_the_first_stages_optimizer_step():
    # Shares of the wall: each stage computes 40% of it and steps 5% of it, but stage 1 steps
    # while stage 0 runs its backward, so only stage 0's step is on the path.
    fractions = {"compute_by_stage": [0.4, 0.4], "optimizer_by_stage": [0.05, 0.05]}
    assert sequential_critical_fraction(fractions) == pytest.approx(0.85)


def test_stage_balance_names_the_busiest_stages_idle_share_and_the_imbalance():
    fractions = {"compute_by_stage": [0.70, 0.82], "optimizer_by_stage": [0.02, 0.02]}
    bubble, imbalance = stage_balance(fractions)
    assert bubble == pytest.approx(0.16) and imbalance == pytest.approx(0.84 / 0.72)


def test_speedup_splits_into_what_the_schedule_overlaps_and_how_fast_the_ops_ran():
    def row(rates, bubbles):
        return {"samples_per_second": stats(rates), "bubble_fraction": stats(bubbles)}

    sequential = row([500.0, 500.0], [0.5, 0.5])  # 1,000 samples per busy second
    # busy 0.8 vs 0.5: 1.6x from the schedule; 600 / 0.8 = 750 per busy second: ops at 0.75x
    parts = speedup_parts(row([600.0, 600.0], [0.2, 0.2]), sequential)
    assert parts["busy_share"]["median"] == pytest.approx(1.6)
    assert parts["op_speed"]["median"] == pytest.approx(0.75)
    assert parts["busy_share"]["median"] * parts["op_speed"]["median"] == pytest.approx(600 / 500)
    # each epoch's rate pairs with its own bubble: a slow epoch is slow ops, not a worse schedule
    parts = speedup_parts(row([800.0, 400.0], [0.2, 0.2]), sequential)
    assert parts["busy_share"] == {"median": pytest.approx(1.6), "min": pytest.approx(1.6), "max": pytest.approx(1.6)}
    assert (parts["op_speed"]["min"], parts["op_speed"]["max"]) == (pytest.approx(0.5), pytest.approx(1.0))
    # no pairing possible: a bubble missing for an epoch
    assert speedup_parts(row([600.0, 600.0], [0.2]), sequential) is None


def test_worker_counts_are_powers_of_two_up_to_the_cluster_and_divide_the_batch():
    assert worker_counts(2, 128) == [1, 2]
    assert worker_counts(6, 128) == [1, 2, 4]  # 6 does not divide 128
    assert worker_counts(6, 96) == [1, 2, 4, 6]
    assert worker_counts(1, 7) == [1]


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
        "rows": 1000, "file_bytes": 2**20,
        "worker_rss_at_start_bytes": 100 * 2**20, "worker_peak_rss_bytes": 150 * 2**20,
        "pyarrow_rows_per_second": stats([2e6]), "raypar_rows_per_second": stats([1e6]),
        "raypar_over_pyarrow": ratio(stats([1e6]), stats([2e6])), "ddp_samples_per_second": stats([1e4]),
        "ingest_over_training": ratio(stats([1e6]), stats([1e4])),
    }
    results = {"suite": "quick", "seconds": 1.0, "ingest": ingest, "plots": "plots skipped: matplotlib not installed",
               "machine": {"cpu_count": 2, "torch": "t", "ray": "r", "python": "p", "platform": "x"}}
    results["targets"] = targets(results)
    text = render(results)
    assert "| ingest rows/s / DDP samples/s                 | >= 5x            |   100.00 | met     |" in text
    assert text.count("| not run |") == 5  # the DDP and pipeline cases did not run
    assert "plots skipped: matplotlib not installed." in text
    assert "steal" not in text  # not measured: no claim either way


def test_quiet_keeps_the_steady_epochs_the_hypervisor_left_alone():
    # first epoch: warm-up; then 1 s at 1% steal, 2 s at 20%, 4 s unknown, 0.5 s at 3%
    assert quiet([9.0, 1.0, 2.0, 4.0, 0.5], [0.0, 0.01, 0.2, None, 0.03], 100) == [100.0, 200.0]
    assert quiet([9.0, 1.0], None, 100) == []  # a run that recorded no steal


def test_the_ddp_target_is_judged_on_quiet_epochs_only_when_both_sides_have_enough():
    def side(all_epochs, quiet_epochs):
        figures = {"samples_per_second": stats(all_epochs)}
        if quiet_epochs:
            figures["samples_per_second_quiet"] = stats(quiet_epochs)
        return figures

    raypar, torch_peer = side([10.0, 50.0], [49.0, 50.0]), side([20.0, 40.0, 50.0], [50.0, 50.5])
    assert quiet_ratio(raypar, torch_peer)["median"] == pytest.approx(49.5 / 50.25)
    assert quiet_ratio(raypar, side([50.0], [50.0])) is None  # one quiet epoch is not enough
    overhead = {"samples_per_second_ratio": ratio(raypar["samples_per_second"], torch_peer["samples_per_second"]),
                "quiet_samples_per_second_ratio": quiet_ratio(raypar, torch_peer)}
    (ddp,) = [t for t in targets({"data_parallel": {"ddp_overhead": overhead}}) if t["name"].startswith("DDP")]
    assert ddp["name"].endswith("epochs with <= 3% steal") and ddp["status"] == "met"
    overhead["quiet_samples_per_second_ratio"] = None
    (ddp,) = [t for t in targets({"data_parallel": {"ddp_overhead": overhead}}) if t["name"].startswith("DDP")]
    assert ddp["name"] == "DDP steady samples/s, raypar / torch" and ddp["status"] == "within noise"


def test_steal_is_the_hypervisors_share_of_the_cpu_time_between_two_readings():
    assert steal_fraction((1000, 10), (1400, 30)) == pytest.approx(0.05)
    assert steal_fraction(None, (1400, 30)) is None  # not Linux
    assert steal_fraction((1000, 10), (1000, 10)) is None  # no time passed
    reading = cpu_times()
    assert reading is None or 0 <= reading[1] <= reading[0]


def test_render_names_the_run_the_hypervisor_slowed_most():
    machine = {"cpu_count": 2, "torch": "t", "ray": "r", "python": "p", "platform": "x",
               "steal_by_run": [{"run": "a, run 1", "steal_fraction": 0.01},
                                {"run": "b, run 1", "steal_fraction": 0.085},
                                {"run": "b, run 2", "steal_fraction": 0.02}]}
    results = {"suite": "quick", "seconds": 1.0, "plots": "none", "machine": machine, "targets": []}
    assert "steal) during the measured runs: median 2.0%, most 8.5% (b, run 1)." in render(results)


def test_fmt_shows_median_then_range_and_collapses_a_flat_range():
    assert fmt(stats([1000, 1200, 1100])) == "1,100 (1,000–1,200)"
    assert fmt(stats([0.5]), ".2f") == "0.50"
    assert fmt(stats([0.001, 0.002]), ".1f", 1e3) == "1.5 (1.0–2.0)"
    assert fmt(None) == "-"


def at_least(v: float) -> bool:
    return v >= 0.97


def test_target_is_met_or_missed_only_when_its_whole_range_agrees():
    assert target("t", stats([0.98, 0.99, 1.2]), ">= 0.97", at_least)["status"] == "met"
    assert target("t", stats([0.8, 0.9, 0.95]), ">= 0.97", at_least)["status"] == "missed"
    # the median alone would say met and missed: the range crosses the goal
    assert target("t", stats([0.9, 0.98, 0.99]), ">= 0.97", at_least)["status"] == "within noise"
    assert target("t", stats([0.9, 0.95, 0.99]), ">= 0.97", at_least)["status"] == "within noise"
    # a two-sided goal: both ends outside, the median inside
    assert target("t", stats([-0.06, 0.0, 0.06]), "±0.05", lambda v: abs(v) <= 0.05)["status"] == "within noise"
    assert target("t", None, ">= 0.97", at_least)["status"] == "not run"


def test_suites_keep_the_global_batch_divisible():
    for suite in SUITES.values():
        assert suite.ddp.batch_size % suite.ddp_workers == 0, suite.name
        assert all(suite.pipeline.batch_size % m == 0 for m in suite.microbatches), suite.name
        assert suite.target_microbatches in suite.microbatches, suite.name


def test_bad_suite_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--suite", "nope"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m ray_jobs.bench: error: --suite 'nope' is unknown; valid: quick, full, smoke (see --help)"
    ]


@pytest.mark.parametrize("shuffle", [True, False])
def test_torch_ddp_peer_with_two_processes_matches_a_single_process_loop(regression_data, shuffle):
    """The peer must train exactly what raypar trains, or the overhead ratio compares different work."""
    cfg = TrainConfig(model="seed-mlp", hidden=8, data=regression_data, epochs=2, batch_size=16, lr=0.05,
                      seed=3, shuffle=shuffle)
    dataset = read_dataset(regression_data)
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg.model, dataset.in_features, dataset.out_features, hidden=8).state_dict()
    got = torch_ddp(cfg, dataset, initial, world_size=2, timeout_s=120)
    expected_state, expected_losses = reference_for(cfg)
    assert_same_weights(got.state, expected_state)
    # the loss of each step is all-reduced as a mean of shard means: float32 summation order.
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
    assert got.world_size == 2 and got.samples_per_second > 0
    assert 0 < got.first_step_s < got.wall_s
    assert len(got.peak_rss_bytes) == 2 and min(got.peak_rss_bytes) > 10 * 2**20
    assert len(got.epoch_steal) == cfg.epochs and all(x is None or 0 <= x <= 1 for x in got.epoch_steal)


@pytest.mark.ray
def test_the_smoke_suite_runs_every_case_end_to_end(ray_cluster, tmp_path):
    """``python -m ray_jobs.bench`` on the shared cluster: every case measured, every target
    judged, and the report re-rendered from bench.json. Its numbers mean nothing and are not
    judged: only that each figure was measured (no timings asserted)."""
    out = tmp_path / "bench"
    results = run_suite(SUITES["smoke"], str(out), str(tmp_path / "storage"), address=None)
    assert results["complete"]
    assert {t["status"] for t in results["targets"]} <= {"met", "missed", "within noise"}  # none "not run"
    saved = json.loads((out / "bench.json").read_text())
    assert render(saved) == (out / "bench.md").read_text()

    overhead = results["data_parallel"]["ddp_overhead"]
    for side in ("raypar", "torch"):
        figures = overhead[side]
        assert 0 < figures["first_step_s"]["median"] < figures["wall_s"]["median"]
        assert figures["after_loop_s"]["median"] > 0
        assert figures["peak_rss_bytes"]["median"] > 10 * 2**20
    assert [p["num_workers"] for p in results["data_parallel"]["scaling"]["points"]] == [1, 2]
    assert results["data_parallel"]["dp_vs_ddp"]["dp"]["samples_per_second"]["median"] > 0

    pipe = results["pipeline"]
    assert {(r["schedule"], r["num_microbatches"], r["transport_requested"]) for r in pipe["configs"]} == {
        (s, m, "p2p") for s in ("sequential", "gpipe", "1f1b") for m in (1, 4)
    } | {("gpipe", 4, "compiled"), ("gpipe", 4, "actor_calls")}
    for row in pipe["configs"]:
        assert row["samples_per_second"]["median"] > 0
        assert 0 <= row["bubble_fraction"]["median"] <= 1
        assert 0 <= row["bubble_busiest_stage"]["median"] <= row["bubble_fraction"]["max"] + 1e-9
        assert row["stage_imbalance"]["median"] >= 1
        assert 0 <= row["bubble_schedule_median_ops"]["median"] <= 1
        # gloo's own calls are timed apart, on the p2p transport only
        calls = row["time_fractions"]["p2p_calls"]["median"]
        assert (0 < calls < 1) if row["transport"] == "p2p_gloo" else calls == 0
        # the speed-up over sequential, split into the schedule's overlap and the ops' speed
        parts = row["speedup_vs_sequential_parts"]
        assert (parts is None) == (row["transport_requested"] != "p2p")
        assert parts is None or min(parts["busy_share"]["median"], parts["op_speed"]["median"]) > 0
    assert results["ingest"]["ingest_over_training"]["median"] > 0


def test_the_published_report_is_what_the_renderer_makes_of_its_json():
    # docs/bench is what the README quotes: its tables must come from its own figures.
    published = REPO / "docs" / "bench"
    results = json.loads((published / "bench.json").read_text())
    assert render(results) == (published / "bench.md").read_text()


def test_render_writes_the_report_anew_from_a_finished_runs_json(tmp_path, capsys):
    shutil.copy(REPO / "docs" / "bench" / "bench.json", tmp_path / "bench.json")
    assert main(["--render", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.md").read_text() == render(results)
    plots = results["plots"]  # PNGs with the bench extra installed, else why not
    assert all((tmp_path / name).is_file() for name in plots) if isinstance(plots, list) else "matplotlib" in plots
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'bench.md'}")


@pytest.mark.parametrize("content", [None, "{not json", '{"suite": "quick", "complete": false}'])
def test_render_of_a_missing_unreadable_or_unfinished_json_is_one_error_line(tmp_path, capsys, content):
    if content is not None:
        (tmp_path / "bench.json").write_text(content)
    assert main(["--render", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --render {tmp_path}: ")
    assert not (tmp_path / "bench.md").exists()
