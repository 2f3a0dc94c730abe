"""Where a pipeline's stage time goes: compute, optimizer, waiting, transport, and the bubble.

The stages time their own ops; this module sums them per epoch and turns them into the shares
``summary.json`` records (and the benchmark reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_jobs.pipeline.schedules import SCHEDULES, replayed_bubble, typical_durations

STAGE_TIME_KEYS = ("compute_s", "optimizer_s", "receive_wait_s", "p2p_calls_s", "data_wait_s")


@dataclass
class PipelineTiming:
    """One attempt's epochs, as the stages timed them."""

    num_stages: int = 1
    samples: int = 0
    epoch_seconds: list[float] = field(default_factory=list)
    epoch_timing: list[dict[str, float]] = field(default_factory=list)  # per epoch, summed over stages
    # per epoch: each stage's op durations and optimizer-step durations, in its own order
    epoch_durations: list[tuple[list[list[float]], list[list[float]]]] = field(default_factory=list)
    peak_alive: int = 0

    def add_epoch(self, seconds: float, samples: int, timings: list[dict[str, float]]) -> None:
        summed: dict[str, float] = {}
        self.epoch_durations.append(([t.pop("op_seconds") for t in timings], [t.pop("step_seconds") for t in timings]))
        for timing in timings:
            self.peak_alive = max(self.peak_alive, timing.pop("peak_live_microbatches"))
            for key, value in timing.items():
                summed[key] = summed.get(key, 0.0) + value
        self.samples += samples
        self.epoch_seconds.append(seconds)
        self.epoch_timing.append(summed)

    @property
    def data_wait_fraction(self) -> float | None:
        """The stages' share of their time (wall x S) spent getting rows."""
        stage_seconds = sum(self.epoch_seconds) * self.num_stages
        return sum(t.get("data_wait_s", 0.0) for t in self.epoch_timing) / stage_seconds if stage_seconds else None

    @property
    def samples_per_second(self) -> float | None:
        seconds = sum(self.epoch_seconds)
        return self.samples / seconds if seconds else None

    def report(self, schedule: str, num_stages: int, num_microbatches: int) -> dict:
        """The timing fields of a pipeline's ``summary.json``."""
        seconds = sum(self.epoch_seconds)
        total = {key: sum(epoch.get(key, 0.0) for epoch in self.epoch_timing) for key in STAGE_TIME_KEYS}
        schedules = SCHEDULES[schedule](num_stages, num_microbatches)
        return {
            "bubble_fraction": bubble_fraction(total, seconds, num_stages),
            "stage_time_fractions": _fractions(total, seconds * num_stages),
            "peak_live_microbatches": self.peak_alive,
            "epoch_seconds": self.epoch_seconds,
            "epoch_stage_time_fractions": [
                {
                    **_fractions(timing, epoch_seconds * num_stages),
                    "bubble": bubble_fraction(timing, epoch_seconds, num_stages),
                    "schedule_bubble": replayed_bubble(schedules, *durations),
                    "median_ops_bubble": replayed_bubble(schedules, *typical_durations(schedules, *durations)),
                    "compute_by_stage": [sum(ops) / epoch_seconds for ops in durations[0]],
                    "optimizer_by_stage": [sum(steps) / epoch_seconds for steps in durations[1]],
                }
                for timing, epoch_seconds, durations in zip(self.epoch_timing, self.epoch_seconds, self.epoch_durations)
            ],
        }


def bubble_fraction(timing: dict[str, float], seconds: float, num_stages: int) -> float | None:
    """Share of the stages' time (wall x S) that is neither forward/backward compute nor the
    optimizer step. The optimizer runs once per batch in every schedule, outside the fill and
    drain that the GPipe theory counts; waiting, transfers and dispatch are bubble."""
    if not seconds:
        return None
    return 1.0 - (timing.get("compute_s", 0.0) + timing.get("optimizer_s", 0.0)) / (seconds * num_stages)


def _fractions(timing: dict[str, float], stage_seconds: float) -> dict[str, float] | None:
    return {key.removesuffix("_s"): value / stage_seconds for key, value in timing.items()} if stage_seconds else None
