"""--grad-clip-norm: the whole model's gradient norm, over every worker and every stage, clipped as
``clip_grad_norm_`` clips it on one process; with a cosine schedule, warmup and (data-parallel)
--grad-accum-steps 2 on together, against the single-process reference that uses torch's
``clip_grad_norm_`` and ``LambdaLR`` directly on whole global batches."""

from __future__ import annotations

import pytest

from ray_jobs.pipeline.scaling import PipelineScaling
from tests.helpers import assert_same_weights, load_weights, reference_for, run_strategy, scheduled_config

pytestmark = pytest.mark.ray

CLIP = 0.05  # below this model's gradient norms on most steps: the clip acts (asserted below)


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("ddp", {"num_workers": 2, "accum": 2}),
        ("dp", {"accum": 2}),
        ("pipeline", {"scaling": PipelineScaling(num_stages=2, num_microbatches=4, schedule="gpipe")}),
        ("pipeline", {"scaling": PipelineScaling(num_stages=2, num_microbatches=4, schedule="1f1b")}),
    ],
    ids=["ddp-2", "dp", "pipeline-gpipe", "pipeline-1f1b"],
)
def test_the_global_norm_is_clipped_as_one_process_clips_it(ray_cluster, regression_data, tmp_path, strategy, options):
    accum = options.pop("accum", 1)
    cfg = scheduled_config(
        regression_data,
        tmp_path,
        grad_accum_steps=accum,
        model="mlp",
        hidden=8,
        depth=3,
        epochs=3,
        batch_size=16,
        seed=3,
        momentum=0.9,
        warmup_steps=4,
        min_lr=0.005,
        grad_clip_norm=CLIP,
    )
    summary = run_strategy(strategy, cfg, **options)
    norms: list[float] = []
    expected, _ = reference_for(cfg, norms=norms)
    assert sum(norm > CLIP for norm in norms) > len(norms) // 2  # the clip acts on most steps
    # Tolerance (assert_same_weights): gloo's all-reduce order and the micro-steps' sums, float32.
    assert_same_weights(load_weights(summary.run_dir), expected)
    # The norm a worker or a stage reports is the whole model's: a stage's own would be smaller.
    # Tolerance: the same float32 sums in another order (over workers' slices, over stages).
    assert summary.grad_norm == pytest.approx({"max": max(norms), "last": norms[-1]}, rel=1e-5)
