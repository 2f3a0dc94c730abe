"""The order rows are visited in, a pure function of the seed and the epoch: order contract v1
(``epoch_order``: one permutation of every row, in memory) and v2 (``stream_windows``: shuffle
windows of row groups, each permuted, when streaming).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Row order of one epoch: DistributedSampler's seeded permutation, or file order."""
    if not shuffle:
        return torch.arange(num_rows)
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))


def stream_windows(
    block_rows: Sequence[int], seed: int, epoch: int, shuffle: bool, window_rows: int
) -> list[list[int]]:
    """Order contract v2 (``--ingest stream``): epoch ``epoch``'s shuffle windows, each a list of
    block indices (Parquet row groups, files in name order) in the window's order. Blocks are
    visited in ``randperm(num_blocks, seed + epoch)`` order (file order without shuffle), and a
    window closes as soon as it holds at least ``window_rows`` rows; the last may hold fewer."""
    if shuffle:
        visit = torch.randperm(len(block_rows), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        visit = list(range(len(block_rows)))
    windows, current, size = [], [], 0
    for block in visit:
        current.append(block)
        size += block_rows[block]
        if size >= window_rows:
            windows.append(current)
            current, size = [], 0
    return windows + [current] if current else windows


def window_permutation(num_rows: int, seed: int, epoch: int, window: int, shuffle: bool) -> torch.Tensor | None:
    """How window ``window`` of epoch ``epoch`` permutes its rows (listed in its block order);
    None without shuffle. The seed is apart from every epoch's block shuffle by 2**32 per window."""
    if not shuffle:
        return None
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch + (window + 1) * 2**32))


def stream_epoch_order(
    block_rows: Sequence[int], seed: int, epoch: int, shuffle: bool, window_rows: int
) -> torch.Tensor:
    """Order contract v2 as global row indices: the windows' permuted rows, concatenated. The
    stream never builds it (each window is permuted as it is read); the tests' reference does."""
    starts = [0]
    for rows in block_rows:
        starts.append(starts[-1] + rows)
    parts = []
    for index, window in enumerate(stream_windows(block_rows, seed, epoch, shuffle, window_rows)):
        rows = torch.cat([torch.arange(starts[block], starts[block + 1]) for block in window])
        permutation = window_permutation(len(rows), seed, epoch, index, shuffle)
        parts.append(rows if permutation is None else rows[permutation])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
