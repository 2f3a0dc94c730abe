"""Pipeline schedules as pure data: each stage's ordered list of forward/backward operations.

The pipeline runner only executes these lists; their correctness (every micro-batch forwarded
and backwarded once per stage, dependencies respected, 1F1B's memory bound) is unit-tested.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

FORWARD, BACKWARD = "F", "B"


class Op(NamedTuple):
    kind: str  # FORWARD or BACKWARD
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """GPipe: every stage runs all forwards, then all backwards (in reverse micro-batch order
    is not needed: gradients accumulate, so backward order only has to follow dependencies)."""
    _check(num_stages, num_microbatches)
    ops = [Op(FORWARD, m) for m in range(num_microbatches)] + [Op(BACKWARD, m) for m in range(num_microbatches)]
    return [list(ops) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """1F1B (PipeDream-flush): stage s warms up with S-s-1 forwards, then alternates one
    forward and one backward, then drains; at most S-s micro-batches' activations are alive."""
    _check(num_stages, num_microbatches)
    schedules = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        ops = [Op(FORWARD, m) for m in range(warmup)]
        next_forward, next_backward = warmup, 0
        while next_forward < num_microbatches:
            ops += [Op(FORWARD, next_forward), Op(BACKWARD, next_backward)]
            next_forward, next_backward = next_forward + 1, next_backward + 1
        ops += [Op(BACKWARD, m) for m in range(next_backward, num_microbatches)]
        schedules.append(ops)
    return schedules


def sequential(num_stages: int, num_microbatches: int) -> list[list[Op]]:
    """No overlap: each micro-batch goes forward and back through every stage before the next
    starts (the classic two-device model-parallel example); the baseline pipelining must beat."""
    _check(num_stages, num_microbatches)
    ops = [op for m in range(num_microbatches) for op in (Op(FORWARD, m), Op(BACKWARD, m))]
    return [list(ops) for _ in range(num_stages)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "sequential": sequential}


def dependency(stage: int, op: Op, num_stages: int) -> tuple[int, Op] | None:
    """The op on another stage whose output this op consumes, if any."""
    if op.kind == FORWARD:
        return (stage - 1, op) if stage > 0 else None
    if stage == num_stages - 1:
        return None  # the last stage's backward starts from its own loss
    return (stage + 1, op)


def execution_order(schedules: list[list[Op]]) -> list[tuple[int, Op]]:
    """One global order that keeps each stage's own order and puts every op after its dependency.

    Raises ``ValueError`` if none exists (the schedule would deadlock).
    """
    num_stages = len(schedules)
    position = [0] * num_stages
    done: set[tuple[int, Op]] = set()
    order: list[tuple[int, Op]] = []
    total = sum(len(ops) for ops in schedules)
    while len(order) < total:
        progressed = False
        for stage, ops in enumerate(schedules):
            while position[stage] < len(ops):
                op = ops[position[stage]]
                needed = dependency(stage, op, num_stages)
                if op.kind == BACKWARD and (stage, Op(FORWARD, op.microbatch)) not in done:
                    break
                if needed is not None and needed not in done:
                    break
                done.add((stage, op))
                order.append((stage, op))
                position[stage] += 1
                progressed = True
        if not progressed:
            stuck = {stage: ops[position[stage]] for stage, ops in enumerate(schedules) if position[stage] < len(ops)}
            raise ValueError(f"schedule deadlocks: stages wait on each other at {stuck}")
    return order


def replayed_bubble(
    schedules: list[list[Op]], op_seconds: list[list[float]], step_seconds: list[list[float]]
) -> float | None:
    """The bubble ``schedules`` would have with these measured durations and instant transfers:
    what the schedule itself costs with these stages on this machine, before any transport,
    wake-up or dispatch. Unlike the GPipe formula it holds for any schedule, for uneven stages
    and for ops slowed now and then (by a noisy CPU), since each op keeps its own duration.

    ``op_seconds[s]``: stage s's op durations over consecutive batches, in its own order;
    ``step_seconds[s]``: its optimizer step of each of those batches.
    """
    num_stages = len(schedules)
    order = execution_order(schedules)
    durations = [iter(seconds) for seconds in op_seconds]
    clock = [0.0] * num_stages
    for steps in zip(*step_seconds):
        finished: dict[tuple[int, Op], float] = {}
        for stage, op in order:
            needed = dependency(stage, op, num_stages)
            start = max(clock[stage], finished[needed] if needed is not None else 0.0)
            clock[stage] = finished[(stage, op)] = start + next(durations[stage])
        clock = [stage_clock + step for stage_clock, step in zip(clock, steps)]
    wall = max(clock)
    busy = sum(map(sum, op_seconds)) + sum(map(sum, step_seconds))
    return 1.0 - busy / (num_stages * wall) if wall else None


def typical_durations(
    schedules: list[list[Op]], op_seconds: list[list[float]], step_seconds: list[list[float]]
) -> tuple[list[list[float]], list[list[float]]]:
    """The same durations with every stage's forwards, backwards and optimizer steps each set
    to that stage's median: replayed, the bubble of the cut itself (uneven stages, the steps),
    without the jitter of single ops, which ``replayed_bubble`` of the raw durations adds."""
    ops_out, steps_out = [], []
    for ops, seconds, steps in zip(schedules, op_seconds, step_seconds):
        kinds = [ops[i % len(ops)].kind for i in range(len(seconds))]
        typical = {kind: statistics.median([s for s, k in zip(seconds, kinds) if k == kind]) for kind in set(kinds)}
        ops_out.append([typical[kind] for kind in kinds])
        steps_out.append([statistics.median(steps)] * len(steps) if steps else [])
    return ops_out, steps_out


def peak_live_activations(ops: list[Op]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point of one stage's list."""
    live = peak = 0
    for op in ops:
        live += 1 if op.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"--num-stages must be at least 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"--num-microbatches must be at least 1, got {num_microbatches}")
