"""Requests the cluster can never meet are refused in one line naming the flag that would fix
them (checked against given nodes, no Ray)."""

from __future__ import annotations

import pytest

from ray_jobs.driver import resources as preflight
from ray_jobs.driver.resources import ResourceError

STAGES = {"CPU": "--cpus-per-stage", "GPU": "--gpus-per-stage"}


@pytest.mark.parametrize(
    ("num_stages", "per_stage", "nodes", "strategy", "message"),
    [
        (
            3,
            {"CPU": 1.0},
            [{"CPU": 1.0}, {"CPU": 1.0}],
            "PACK",
            "--num-stages 3 asks for 3 CPU in all; the cluster has 2 CPU (2 node(s): 2 CPU): lower --cpus-per-stage "
            "(0.5 fits) or lower --num-stages (2 fit) or add nodes",
        ),
        (
            2,
            {"CPU": 4.0},
            [{"CPU": 2.0}] * 4,
            "PACK",
            "--num-stages 2: no single node has 4 CPU for one of them: lower --cpus-per-stage to at most 2",
        ),
        (
            2,
            {"CPU": 1.0},
            [{"CPU": 1.0}] * 4,
            "STRICT_PACK",
            "--num-stages 2 with STRICT_PACK needs 2 CPU on one node; no node has that: use --placement-strategy PACK",
        ),
        (
            2,
            {"CPU": 1.0, "GPU": 0.5},
            [{"CPU": 8.0, "GPU": 0.0}],
            "PACK",
            "asks for 1 GPU in all; the cluster has 0 GPU (1 node(s): 8 CPU, 0 GPU): "
            "add nodes that have it or drop --use-gpu",
        ),
    ],
)
def test_every_refusal_names_the_flag_that_would_fix_it(num_stages, per_stage, nodes, strategy, message):
    request = preflight.Request("--num-stages", num_stages, STAGES)
    with pytest.raises(ResourceError) as refused:
        preflight.check_bundles([per_stage] * num_stages, strategy, request, nodes)
    assert message in str(refused.value)
