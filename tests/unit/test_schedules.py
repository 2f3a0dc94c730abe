"""Pipeline schedules: complete, dependency-ordered, and within 1F1B's memory bound."""

from __future__ import annotations

import pytest

from ray_jobs.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    SCHEDULES,
    Op,
    execution_order,
    gpipe,
    one_f_one_b,
    peak_live_activations,
    replayed_bubble,
    sequential,
    typical_durations,
)
from ray_jobs.pipeline.stage import MIN_RECEIVES_AHEAD, receives_ahead

SHAPES = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 8), (3, 4), (4, 2), (4, 4), (4, 16), (8, 8), (8, 3)]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_every_microbatch_forward_then_backward_once_per_stage(name, num_stages, num_microbatches):
    schedules = SCHEDULES[name](num_stages, num_microbatches)
    assert len(schedules) == num_stages
    for ops in schedules:
        expected = {Op(kind, m) for kind in (FORWARD, BACKWARD) for m in range(num_microbatches)}
        assert sorted(ops) == sorted(expected)
        for m in range(num_microbatches):
            assert ops.index(Op(FORWARD, m)) < ops.index(Op(BACKWARD, m))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_a_global_order_respects_cross_stage_dependencies(name, num_stages, num_microbatches):
    order = execution_order(SCHEDULES[name](num_stages, num_microbatches))
    seen = {entry: index for index, entry in enumerate(order)}
    for (stage, op), index in seen.items():
        if op.kind == FORWARD and stage > 0:
            assert seen[(stage - 1, op)] < index  # activation comes from the previous stage
        if op.kind == BACKWARD and stage < num_stages - 1:
            assert seen[(stage + 1, op)] < index  # gradient comes from the next stage
        if op.kind == BACKWARD and stage == num_stages - 1:
            assert seen[(stage, Op(FORWARD, op.microbatch))] < index  # the loss comes first
    for stage in range(num_stages):  # each stage keeps its own order
        assert [op for s, op in order if s == stage] == SCHEDULES[name](num_stages, num_microbatches)[stage]


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SHAPES)
def test_1f1b_keeps_at_most_num_stages_activations_alive(num_stages, num_microbatches):
    for stage, ops in enumerate(one_f_one_b(num_stages, num_microbatches)):
        assert peak_live_activations(ops) <= min(num_stages - stage, num_microbatches)
    # GPipe holds every micro-batch: that is what 1F1B saves.
    assert peak_live_activations(gpipe(num_stages, num_microbatches)[0]) == num_microbatches


def test_known_1f1b_shape():
    assert one_f_one_b(3, 4) == [
        [Op("F", 0), Op("F", 1), Op("F", 2), Op("B", 0), Op("F", 3), Op("B", 1), Op("B", 2), Op("B", 3)],
        [Op("F", 0), Op("F", 1), Op("B", 0), Op("F", 2), Op("B", 1), Op("F", 3), Op("B", 2), Op("B", 3)],
        [Op("F", 0), Op("B", 0), Op("F", 1), Op("B", 1), Op("F", 2), Op("B", 2), Op("F", 3), Op("B", 3)],
    ]


def test_a_deadlocking_schedule_is_rejected():
    bad = [[Op("F", 0), Op("B", 0)], [Op("B", 0), Op("F", 0)]]
    with pytest.raises(ValueError, match="deadlocks"):
        execution_order(bad)


@pytest.mark.parametrize("bad", [(0, 4), (2, 0)])
def test_bad_sizes(bad):
    with pytest.raises(ValueError, match="must be at least 1"):
        gpipe(*bad)


def _replay(name: str, num_stages: int, num_microbatches: int, forward, backward, num_batches=3, step=0.0):
    """Replay ``num_batches`` batches where stage s's forward takes forward[s] and backward backward[s]."""
    schedules = SCHEDULES[name](num_stages, num_microbatches)
    ops = [
        [(forward if op.kind == FORWARD else backward)[s] for op in ops] * num_batches
        for s, ops in enumerate(schedules)
    ]
    return replayed_bubble(schedules, ops, [[step] * num_batches for _ in range(num_stages)])


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 8), (4, 4), (3, 1)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_replay_of_equal_stages_is_the_gpipe_formula(name, num_stages, num_microbatches):
    # Exact in exact arithmetic: float rounding only.
    bubble = _replay(name, num_stages, num_microbatches, [1.0] * num_stages, [2.0] * num_stages)
    assert bubble == pytest.approx((num_stages - 1) / (num_microbatches + num_stages - 1), abs=1e-12)


def test_replay_of_uneven_and_unoverlapped_stages():
    # GPipe, stage 1 slower: a batch takes (M-1) x the slowest stage's micro-batch plus one
    # micro-batch through every stage.
    wall = 7 * (1.5 + 3.0) + (1.0 + 2.0) + (1.5 + 3.0)
    expected = 1 - 8 * (3.0 + 4.5) / (2 * wall)
    assert _replay("gpipe", 2, 8, [1.0, 1.5], [2.0, 3.0]) == pytest.approx(expected, abs=1e-12)
    assert _replay("sequential", 2, 4, [1.0, 1.0], [2.0, 2.0]) == pytest.approx(0.5, abs=1e-12)  # one at a time
    assert _replay("gpipe", 1, 4, [1.0], [2.0]) == 0.0  # one stage never waits
    # An optimizer step delays the next batch on its own stage only.
    assert _replay("gpipe", 1, 4, [1.0], [2.0], step=1.0) == 0.0


def test_receives_are_posted_as_far_ahead_as_the_schedule_keeps_microbatches_alive():
    # GPipe holds every micro-batch, so every receive is posted; 1F1B's bound holds the buffers
    # to S - s; never fewer than MIN_RECEIVES_AHEAD, so a receive is always posted before need.
    assert [receives_ahead(ops) for ops in gpipe(2, 8)] == [8, 8]
    assert [receives_ahead(ops) for ops in one_f_one_b(4, 8)] == [4, 3, 2, 2]
    assert MIN_RECEIVES_AHEAD == 2 and receives_ahead(sequential(2, 8)[0]) == 2


def test_median_ops_replay_is_the_cut_without_the_jitter_of_single_ops():
    schedules = gpipe(2, 4)
    even = [[1.0 if op.kind == FORWARD else 2.0 for op in ops] * 3 for ops in schedules]
    steps = [[0.0] * 3, [0.0] * 3]
    # one slow backward on stage 1: the measured replay pays for it, the median replay does not
    jittered = [list(even[0]), list(even[1])]
    jittered[1][4] = 6.0
    ops, typical_steps = typical_durations(schedules, jittered, steps)
    assert ops == even and typical_steps == steps
    assert replayed_bubble(schedules, *typical_durations(schedules, jittered, steps)) == pytest.approx(1 / 5)
    assert replayed_bubble(schedules, jittered, steps) > 1 / 5
    # an uneven cut stays uneven: each stage keeps its own medians, per kind and per step
    uneven = [
        [1.0 if op.kind == FORWARD else 2.0 for op in schedules[0]] * 3,
        [1.5 if op.kind == FORWARD else 3.0 for op in schedules[1]] * 3,
    ]
    ops, typical_steps = typical_durations(schedules, uneven, [[0.1, 0.3, 0.2], [0.5, 0.5, 0.5]])
    assert ops == uneven and typical_steps == [[0.2] * 3, [0.5] * 3]
