"""The bytes autograd holds for backward (``observability.saved_tensors``), against a count by hand."""

from __future__ import annotations

import torch
from torch import nn

from ray_jobs.core.step import train_step
from ray_jobs.observability.saved_tensors import saved_tensor_bytes

FLOAT = 4  # bytes


def test_a_forward_holds_its_inputs_and_activations_once_and_frees_them_with_its_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    with saved_tensor_bytes(model.parameters()) as saved:
        loss = nn.functional.mse_loss(model(x), y)
        # the first Linear's input x; the ReLU's output, which the second Linear saves too (once);
        # the loss's input and target; the weights (parameters) not at all
        held = 32 * (8 + 16 + 4 + 4) * FLOAT
        assert saved.live_bytes == saved.peak_bytes == held
        loss.backward()
    assert saved.live_bytes == 0 and saved.peak_bytes == held


def test_accumulation_holds_one_micro_step_of_activations_at_a_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = torch.randn(64, 8), torch.randn(64, 4)
    peaks = {}
    for accum_steps in (1, 4):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        with saved_tensor_bytes(model.parameters()) as saved:
            train_step(model, optimizer, nn.MSELoss(), x, y, accum_steps=accum_steps)
        peaks[accum_steps] = saved.peak_bytes
    assert peaks[1] == 64 * (8 + 64 + 4 + 4) * FLOAT
    assert peaks[4] == 16 * (8 + 64 + 4 + 4) * FLOAT  # each micro-step's graph is freed by its backward
