"""A pipeline stage holds its own layers only: built on the meta device, sent only its slice. No Ray."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict

import torch

from ray_jobs.core.config import TrainConfig
from ray_jobs.core.model_init import initial_model
from ray_jobs.data.parquet import read_dataset
from ray_jobs.pipeline.cut import stage_keys
from ray_jobs.pipeline.stage import StageWorker
from tests.helpers import REPO, modules_after


def test_a_stage_gets_exactly_its_slice_of_the_initial_weights(regression_data):
    cfg = TrainConfig(model="mlp", hidden=16, depth=4, data=regression_data)
    dataset = read_dataset(regression_data)
    full = initial_model(cfg, dataset).state_dict()
    keys = stage_keys(cfg, dataset, 2)
    assert keys[0] | keys[1] == set(full) and not keys[0] & keys[1]
    stage = StageWorker(1, 2, 2, asdict(cfg), dataset, {k: full[k] for k in keys[1]}, 1, False)
    own = stage.module.state_dict()
    assert set(own) == keys[1]
    for key, value in own.items():
        assert value.device.type == "cpu" and torch.equal(value, full[key]), key


def test_building_a_stage_never_builds_the_whole_model():
    """Stage 7 of 8 of an mlp of width 4096: the process grows by its 32 MiB slice, not by the
    448 MiB model. The same stage of a width-64 model gives the fixed growth of any first
    torch use (~76 MiB measured), which the comparison cancels."""
    script = (
        "import sys, numpy as np, torch\n"
        "from dataclasses import asdict\n"
        "from ray_jobs.core.config import TrainConfig\n"
        "from ray_jobs.data.parquet import Dataset\n"
        "from ray_jobs.observability.process_stats import peak_rss_bytes\n"
        "from ray_jobs.pipeline.cut import meta_stages\nfrom ray_jobs.pipeline.stage import StageWorker\n"
        "cfg = TrainConfig(model='mlp', hidden=int(sys.argv[1]), depth=8)\n"
        "dataset = Dataset(np.zeros((4, 2048), np.float32), np.zeros((4, 2048), np.float32), 'regression')\n"
        "own = {k: torch.zeros(v.shape) for k, v in meta_stages(cfg, dataset, 8)[7].state_dict().items()}\n"
        "before = peak_rss_bytes()\n"
        "StageWorker(7, 8, 8, asdict(cfg), dataset, own, 1, False)\n"
        "print((peak_rss_bytes() - before) / 2**20)\n"
    )

    def growth(hidden: int) -> float:
        result = subprocess.run(
            [sys.executable, "-c", script, str(hidden)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return float(result.stdout)

    assert growth(4096) - growth(64) < 64  # measured 32: the slice; building the whole model first added 448


def test_a_stage_actor_loads_fsdps_modules_only_on_a_sharded_stage():
    """torch.distributed.tensor and FSDP2 cost each stage actor ~0.6 s of its start (2.0 s against
    1.3 s for the stage's imports); an unsharded pipeline, the usual one, never uses them."""
    loaded = [m for m in modules_after("import ray_jobs.pipeline.stage") if m.startswith("torch.distributed.")]
    assert not [m for m in loaded if m.split(".")[2] in ("tensor", "fsdp", "checkpoint")], loaded
