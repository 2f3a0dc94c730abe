"""The bench's statistics (no Ray): repetitions, ratios, quiet epochs, the pipeline's theory, targets."""

from __future__ import annotations

import pytest

from ray_jobs.bench.stats import (
    gpipe_bubble,
    quiet,
    quiet_ratio,
    ratio,
    sequential_critical_fraction,
    speedup_parts,
    stage_balance,
    stats,
    steady,
    summarise,
    target,
    targets,
    transfer_overhead_us,
)
from ray_jobs.observability.process_stats import cpu_times, steal_fraction


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
    runs = [
        {"samples_per_second": [1.0, 5.0], "wall_s": 10.0, "transport": "p2p_gloo"},
        {"samples_per_second": [3.0], "wall_s": 12.0, "transport": "p2p_gloo"},
    ]
    figures = summarise(runs, text=("transport",))
    assert figures["samples_per_second"] == stats([1.0, 5.0, 3.0])
    assert figures["wall_s"]["median"] == 11.0 and figures["transport"] == "p2p_gloo"


def test_summarise_leaves_out_what_a_run_did_not_measure():
    runs = [
        {"wall_s": 10.0, "steal_fraction": None, "off_linux": None},
        {"wall_s": 12.0, "steal_fraction": 0.1},
        {"wall_s": 14.0, "steal_fraction": 0.3},
    ]
    figures = summarise(runs)
    assert figures["steal_fraction"] == stats([0.1, 0.3]) and "off_linux" not in figures


def test_gpipe_bubble_theory():
    assert gpipe_bubble(2, 8) == pytest.approx(1 / 9)
    assert gpipe_bubble(4, 4) == pytest.approx(3 / 7)
    assert gpipe_bubble(1, 16) == 0.0  # one stage never waits
    assert gpipe_bubble(2, 1) == pytest.approx(1 / 2)  # one micro-batch: each stage idles half the time
    with pytest.raises(ValueError):
        gpipe_bubble(0, 4)


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
    overhead = {
        "samples_per_second_ratio": ratio(raypar["samples_per_second"], torch_peer["samples_per_second"]),
        "quiet_samples_per_second_ratio": quiet_ratio(raypar, torch_peer),
    }
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
