"""Order contract v2 (``--ingest stream``), checked against the specification written out by hand."""

from __future__ import annotations

import torch

from ray_jobs.core.batches import global_batches, shard
from ray_jobs.data.order import stream_epoch_order, stream_windows, window_permutation

BLOCKS = [7, 16, 5, 9, 12, 3, 16, 8]  # uneven row groups, as several files give them
SEED, WINDOW = 5, 20


def test_the_order_is_a_permutation_of_every_row():
    for epoch in range(3):
        order = stream_epoch_order(BLOCKS, SEED, epoch, True, WINDOW)
        assert sorted(order.tolist()) == list(range(sum(BLOCKS)))
    assert stream_epoch_order(BLOCKS, SEED, 0, False, WINDOW).tolist() == list(range(sum(BLOCKS)))  # file order


def test_windows_and_block_order_as_specified():
    epoch = 2
    visit = torch.randperm(len(BLOCKS), generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
    windows = stream_windows(BLOCKS, SEED, epoch, True, WINDOW)
    assert [block for window in windows for block in window] == visit
    for window in windows[:-1]:  # each closes as soon as it holds at least WINDOW rows
        sizes = [BLOCKS[b] for b in window]
        assert sum(sizes) >= WINDOW and sum(sizes[:-1]) < WINDOW
    starts = [sum(BLOCKS[:b]) for b in range(len(BLOCKS))]
    expected = []
    for k, window in enumerate(windows):
        rows = [starts[b] + i for b in window for i in range(BLOCKS[b])]
        permutation = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED + epoch + (k + 1) * 2**32))
        expected += [rows[p] for p in permutation.tolist()]
    assert stream_epoch_order(BLOCKS, SEED, epoch, True, WINDOW).tolist() == expected
    assert window_permutation(5, SEED, epoch, 0, False) is None


def test_every_worker_count_trains_on_the_same_batches():
    order = stream_epoch_order(BLOCKS, SEED, 1, True, WINDOW)
    for num_workers in (1, 2, 4):
        seen = [
            torch.cat([shard(batch, num_workers, rank) for rank in range(num_workers)])
            for batch in global_batches(order, 16)
        ]
        assert torch.equal(torch.cat(seen), order[: len(order) // 16 * 16])


def test_a_mid_epoch_position_needs_only_the_row_group_sizes():
    """Where global batch s starts (window and offset) follows from the metadata alone, so a
    resume reads no window before it."""
    epoch, batch_size, step = 1, 16, 3
    windows = stream_windows(BLOCKS, SEED, epoch, True, WINDOW)
    sizes = [sum(BLOCKS[b] for b in window) for window in windows]
    position = step * batch_size
    window = next(k for k in range(len(sizes)) if sum(sizes[: k + 1]) > position)
    offset = position - sum(sizes[:window])
    order = stream_epoch_order(BLOCKS, SEED, epoch, True, WINDOW)
    rows = [sum(BLOCKS[:b]) + i for b in windows[window] for i in range(BLOCKS[b])]
    permutation = window_permutation(len(rows), SEED, epoch, window, True)
    assert order[position].item() == rows[permutation[offset].item()]
