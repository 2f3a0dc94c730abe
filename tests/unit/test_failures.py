"""A failure's one line: where it happened, then what, found under any of Ray's wrapping."""

from __future__ import annotations

import torch

from ray_jobs.errors import Failure, describe, root_cause


def test_describe_names_where_and_cuda_out_of_memory():
    assert describe(ValueError("bad shape\ndetails"), "stage 1") == "stage 1: ValueError: bad shape"
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert describe(oom, "world rank 3") == "world rank 3: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_root_cause_finds_the_described_failure_under_any_wrapping():
    try:
        try:
            raise Failure("stage 1: RuntimeError: injected fault") from KeyError("inner")
        except Failure as failure:
            raise RuntimeError("ray::StageWorker.run_batches() (pid=1)\n  Traceback ...") from failure
    except RuntimeError as wrapped:
        assert root_cause(wrapped) == "stage 1: RuntimeError: injected fault"
    assert root_cause(RuntimeError("outer")) == "outer"
    # Ray Train passes a worker's error on as its traceback's text
    text = "Traceback (most recent call last):\n  ...\nray_jobs.errors.Failure: world rank 1: KeyError: 'x'"
    assert root_cause(RuntimeError(text)) == "world rank 1: KeyError: 'x'"


def test_a_live_stages_error_restarts_the_pipeline_only_when_a_stage_is_found_dead():
    """A DP x PP replica's all-reduce fails with gloo's "Connection reset by peer" when the
    other replica's stage dies, and that error can reach the driver first (seen in CI): with a
    dead stage found it is a lost stage, restarted; with every stage alive, the run's error."""
    from types import SimpleNamespace

    from ray.exceptions import RayTaskError

    from ray_jobs.errors import PeerLost
    from ray_jobs.pipeline.trainer import _lost_stage

    echo = RayTaskError("run_batches", "traceback", Failure("stage 1 of replica 0: RuntimeError: Connection reset"))
    dead = SimpleNamespace(dead_stage=lambda: "stage 1 of replica 1 actor on node n died")
    alive = SimpleNamespace(dead_stage=lambda: None)
    assert _lost_stage(dead, echo) == "stage 1 of replica 1 actor on node n died"
    assert _lost_stage(alive, echo) is None
    assert _lost_stage(None, echo) is None  # nothing started to probe
    lost = SimpleNamespace(describe_failure=lambda error: f"described {type(error).__name__}")
    assert _lost_stage(lost, PeerLost("stage 0: reset")) == "described PeerLost"
