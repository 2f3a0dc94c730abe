"""Pipeline schedules: complete, dependency-ordered, and within 1F1B's memory bound."""
from __future__ import annotations

import pytest

from ray_jobs.schedules import (
    BACKWARD,
    FORWARD,
    Op,
    SCHEDULES,
    execution_order,
    gpipe,
    one_f_one_b,
    peak_live_activations,
)

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
