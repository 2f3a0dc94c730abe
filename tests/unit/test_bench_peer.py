"""The bench's plain-torch peer (no Ray): it trains exactly what raypar trains."""

from __future__ import annotations

import os

import pytest
import torch

from models import build_model
from ray_jobs.bench.peer import torch_ddp
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.model_init import initial_model
from ray_jobs.data.parquet import read_dataset
from tests.helpers import assert_same_weights, modules_after, reference_for, write_tokens

GPT = ["n_layer=2", "n_head=2", "n_embd=16"]


@pytest.mark.parametrize("shuffle", [True, False])
def test_torch_ddp_peer_with_two_processes_matches_a_single_process_loop(regression_data, shuffle):
    """The peer must train exactly what raypar trains, or the overhead ratio compares different work."""
    cfg = TrainConfig(
        model="seed-mlp", hidden=8, data=regression_data, epochs=2, batch_size=16, lr=0.05, seed=3, shuffle=shuffle
    )
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


def test_the_peers_processes_import_no_ray():
    """The peer's spawned processes import its module: Ray there would inflate the start-up cost
    that raypar's is compared with."""
    assert [m for m in modules_after("import ray_jobs.bench.peer") if m.split(".")[0] == "ray"] == []


def test_torch_ddp_peer_trains_the_gpt_of_one_process(tmp_path):
    """The lm case's peer: int64 tokens, the token cross-entropy, and the gpt built as raypar builds
    it (its block_size the data's context length, given by no option)."""
    data = write_tokens(str(tmp_path / "tokens.parquet"), rows=32, block_size=8)
    cfg = TrainConfig(
        model="gpt", model_option=GPT, task="lm", data=data, epochs=2, batch_size=8, lr=0.5, seed=4, shuffle=True
    )
    dataset = read_dataset(data, task="lm")
    initial = initial_model(cfg, dataset).state_dict()
    niceness = min(19, os.nice(0) + 2)  # as Ray's workers run at 15: the peer can be asked to run alike
    got = torch_ddp(cfg, dataset, initial, world_size=2, timeout_s=120, niceness=niceness)
    assert got.niceness == niceness
    expected_state, expected_losses = reference_for(cfg)
    assert_same_weights(got.state, expected_state)  # gloo's all-reduce sums in another order, float32
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-6)
