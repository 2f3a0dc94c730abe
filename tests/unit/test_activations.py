"""--activation-checkpointing: the same gradients as without it, dropout included; the one count
of the bytes autograd holds for backward (``core.activations.HeldForBackward``) against counts by
hand, with and without checkpointing or accumulation; and which children FSDP shards on their own."""

from __future__ import annotations

import torch
from torch import nn

from models import build_model
from ray_jobs.core.activations import HeldForBackward, checkpoint_activations
from ray_jobs.core.shard_plan import shard_units
from ray_jobs.core.step import train_step

FLOAT = 4  # bytes


def _gradients(model: nn.Module, x: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)  # the dropout masks' draws
    model.zero_grad()
    model(x).pow(2).mean().backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def test_checkpointed_blocks_give_the_same_gradients_bit_for_bit_dropout_included():
    torch.manual_seed(0)
    plain = build_model("mlp", 6, 3, hidden=16, depth=4, dropout=0.3)
    checkpointed = build_model("mlp", 6, 3, hidden=16, depth=4, dropout=0.3)
    checkpointed.load_state_dict(plain.state_dict())
    assert checkpoint_activations(checkpointed) == ["fc0", "fc1", "fc2", "fc3"]  # not the ReLUs, dropouts
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # names unchanged: checkpoints load alike
    x = torch.randn(32, 6)
    expected, got = _gradients(plain, x, seed=4), _gradients(checkpointed, x, seed=4)
    for name in expected:
        # the recompute replays the forward's RNG state, so the masks and the bits are the same
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)


def test_a_forward_holds_its_inputs_and_activations_once_and_frees_them_with_its_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    with HeldForBackward(model).counting() as saved:
        loss = nn.functional.mse_loss(model(x), y)
        # the first Linear's input x; the ReLU's output, which the second Linear saves too (once);
        # the loss's input and target; the weights (parameters) not at all
        held = 32 * (8 + 16 + 4 + 4) * FLOAT
        assert saved.live_bytes == saved.peak_bytes == held
        loss.backward()
    assert saved.live_bytes == 0 and saved.peak_bytes == held
    with saved.counting():  # counted again (the sharding bench, each step): the peak since it began
        nn.functional.mse_loss(model(x[:16]), y[:16]).backward()
    assert saved.live_bytes == 0 and saved.peak_bytes == held // 2


def test_accumulation_holds_one_micro_step_of_activations_at_a_time():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = torch.randn(64, 8), torch.randn(64, 4)
    peaks = {}
    for accum_steps in (1, 4):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        with HeldForBackward(model).counting() as saved:
            train_step(model, optimizer, nn.MSELoss(), x, y, accum_steps=accum_steps)
        peaks[accum_steps] = saved.peak_bytes
    assert peaks[1] == 64 * (8 + 64 + 4 + 4) * FLOAT
    assert peaks[4] == 16 * (8 + 64 + 4 + 4) * FLOAT  # each micro-step's graph is freed by its backward


def test_a_checkpointed_gpt_like_stack_holds_less_for_backward():
    """Blocks of several ops each (as a transformer's): with checkpointing, only each block's
    input is held until backward."""
    torch.manual_seed(0)
    width = 64

    def block() -> nn.Module:
        return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    plain = nn.Sequential(*(block() for _ in range(4)))
    checkpointed = nn.Sequential(*(block() for _ in range(4)))
    checkpoint_activations(checkpointed)
    x = torch.randn(128, width)
    held = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        with HeldForBackward(model).counting() as held_now:
            out = model(x)
        held[name] = held_now.live_bytes
        out.sum().backward()
        assert held_now.live_bytes == 0 and held_now.peak_bytes == held[name]  # the checkpoint's inputs freed too
    row_bytes = 128 * width * FLOAT
    assert held["checkpointed"] == 4 * row_bytes  # each block's input, the batch's included
    # without, per block: the LayerNorm's input (1 width) and its mean and rstd (1 float each per
    # row), the first Linear's input (1), the GELU's input (4) and the second Linear's input (4)
    assert held["plain"] == 4 * (10 * row_bytes + 2 * 128 * FLOAT)


def test_fsdp_shards_each_child_alone_unless_it_shares_a_parameter():
    head = nn.Linear(8, 8)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Sequential(head, nn.Tanh()), nn.Linear(8, 8), nn.Linear(8, 3))
    model[3].weight = head.weight  # tied by identity, under another name and one level down
    assert shard_units(model) == ["0", "4"]


def test_model_state_bytes_counts_parameters_gradients_and_optimizer_state_once_each():
    from ray_jobs.observability.model_memory import model_state_bytes

    first = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(first, nn.Linear(4, 4, bias=False))
    model[1].weight = first.weight  # tied: one storage
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert model_state_bytes(model, optimizer) == {"parameters": 64, "gradients": 0, "optimizer": 0, "total": 64}
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    # AdamW: two moments of 16 floats, and its step count (a 0-d float32 tensor)
    assert model_state_bytes(model, optimizer) == {"parameters": 64, "gradients": 64, "optimizer": 132, "total": 260}


def test_compile_blocks_compiles_each_blocks_forward_and_keeps_every_name(monkeypatch):
    """The instance's forward is replaced, so state_dict keys (and checkpoints) are eager's; a
    block without parameters is left alone. torch.compile itself is stood in for: compiling
    takes seconds, and the Ray tests train compiled blocks to the eager reference."""
    from ray_jobs.core.activations import compile_blocks

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn: compiled.append(fn) or fn)
    model = build_model("gpt", 16, 16, n_layer=2, n_head=2, n_embd=8, block_size=4)
    keys = list(model.state_dict())
    assert compile_blocks(model) == ["embed", "block_0", "block_1", "head"]
    assert list(model.state_dict()) == keys and len(compiled) == 4
    holder = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert compile_blocks(holder) == ["0"]
