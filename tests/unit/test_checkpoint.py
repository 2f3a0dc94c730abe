"""The checkpoint format and how resume picks a checkpoint: no Ray."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ray_jobs.core.checkpoint import (
    TrainState,
    checkpoint_name,
    latest_checkpoint,
    latest_progress,
    prune_checkpoints,
    read_checkpoint,
    slice_state,
    write_checkpoint,
)
from tests.helpers import REPO


def state(epochs: int) -> TrainState:
    return TrainState(
        {"fc.weight": torch.full((2, 2), float(epochs))},
        {"state": {}, "param_groups": []},
        epochs,
        [1.0] * epochs,
        [{"cpu": torch.get_rng_state(), "cuda": None}],
    )


def write(run_dir, name: str, epochs: int) -> str:
    write_checkpoint(str(run_dir / name), state(epochs))
    return str(run_dir / name / "checkpoint.pt")


def same_times(run_dir, stamp: float = 1_000_000_000.0) -> None:
    """Every file and directory at one whole second, as object stores keep them."""
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (stamp, stamp))


def test_newest_by_completed_work_not_file_times(tmp_path):
    assert latest_checkpoint(str(tmp_path / "absent")) is None and latest_progress(str(tmp_path)) is None
    for epochs in (3, 1, 2):
        write(tmp_path, checkpoint_name(epochs), epochs)
    (tmp_path / "checkpoint_manager_snapshot.json").write_text("{}")  # Ray's registry: not a checkpoint
    same_times(tmp_path)
    assert latest_checkpoint(str(tmp_path)).epochs_completed == 3
    assert latest_progress(str(tmp_path)) == (3, 0)
    # A copied run directory (cp -r, aws s3 sync): times reset, the oldest copied last.
    copy = tmp_path.parent / "copy"
    shutil.copytree(tmp_path, copy, copy_function=shutil.copy)
    os.utime(copy / checkpoint_name(1) / "checkpoint.pt")  # now the newest file
    assert latest_checkpoint(str(copy)).epochs_completed == 3


def test_a_checkpoint_cut_short_is_never_trusted(tmp_path):
    write(tmp_path, checkpoint_name(1), 1)
    write(tmp_path, checkpoint_name(2), 2)
    newest = write(tmp_path, checkpoint_name(3), 3)
    with open(newest, "r+b") as file:
        file.truncate(os.path.getsize(newest) // 2)
    empty = write(tmp_path, checkpoint_name(4), 4)  # a disk full when the file was created
    open(empty, "wb").close()
    restored = latest_checkpoint(str(tmp_path))
    assert restored.epochs_completed == 2 and torch.equal(restored.model["fc.weight"], torch.full((2, 2), 2.0))


def test_checkpoints_an_older_raypar_named_by_time_are_read_by_content(tmp_path):
    write(tmp_path, "checkpoint_2026-12-01_10-00-09.000000", 2)  # Ray's timestamp names
    write(tmp_path, "checkpoint_2026-12-01_10-00-10.000000", 1)
    assert latest_checkpoint(str(tmp_path)).epochs_completed == 2
    write(tmp_path, checkpoint_name(3), 3)
    assert latest_checkpoint(str(tmp_path)).epochs_completed == 3 and latest_progress(str(tmp_path)) == (3, 0)


def test_partial_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoint_x").mkdir()
    (tmp_path / "checkpoint_x" / "checkpoint.pt.partial").write_bytes(b"half")
    assert latest_checkpoint(str(tmp_path)) is None


def test_prune_keeps_the_newest_by_progress(tmp_path):
    for epochs in (1, 2, 10):
        write(tmp_path, checkpoint_name(epochs), epochs)
    prune_checkpoints(str(tmp_path), 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(2), checkpoint_name(10)]


def test_a_checkpoint_written_before_every_rank_kept_its_rng_still_loads(tmp_path):
    old = {"model": {}, "optimizer": {}, "epochs_completed": 1, "losses": [0.5], "rng": torch.get_rng_state()}
    (tmp_path / "checkpoint_old").mkdir()
    torch.save(old, tmp_path / "checkpoint_old" / "checkpoint.pt")
    restored = read_checkpoint(str(tmp_path / "checkpoint_old"))
    assert torch.equal(restored.rng[0]["cpu"], old["rng"]) and restored.step == 0


def test_a_stage_gets_only_its_slice():
    full = TrainState(
        {"a.weight": torch.ones(1), "b.weight": torch.zeros(1)},
        {
            "state": {"a.weight": {"momentum_buffer": torch.ones(1)}, "b.weight": {"momentum_buffer": torch.ones(1)}},
            "param_groups": [{"lr": 0.1, "params": ["a.weight", "b.weight"]}],
        },
        2,
        [1.0, 0.5],
        [{"cpu": torch.tensor([0], dtype=torch.uint8)}, {"cpu": torch.tensor([1], dtype=torch.uint8)}],
    )
    part = slice_state(full, {"b.weight"}, 1, 2)
    assert list(part.model) == ["b.weight"] and list(part.optimizer["state"]) == ["b.weight"]
    assert part.optimizer["param_groups"] == [{"lr": 0.1, "params": ["b.weight"]}]
    assert part.rng[0]["cpu"].item() == 1
    assert slice_state(full, {"b.weight"}, 1, 3).rng == []  # taken with another stage count


def test_writing_a_checkpoint_copies_no_tensor(tmp_path):
    """The old path deep-copied the state and copied its bytes again: +2x the state at its peak."""
    script = (
        "import sys, torch\n"
        "from ray_jobs.core.checkpoint import TrainState, write_checkpoint\n"
        "from ray_jobs.observability.process_stats import peak_rss_bytes\n"
        "size = 128 * 2**20\n"
        "state = TrainState({'w': torch.ones(size // 4)}, {'state': {}, 'param_groups': []}, 1, [1.0])\n"
        "before = peak_rss_bytes()\n"
        "write_checkpoint(sys.argv[1], state)\n"
        "print((peak_rss_bytes() - before) / size)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert float(result.stdout) < 0.25  # measured 0.004: only the file writer's own buffers


def cut_short(path: str) -> None:
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)


def test_one_function_decides_the_newest_usable_checkpoint_for_every_caller(tmp_path, capsys):
    """A checkpoint cut short mid-upload is skipped by resume, the re-run check and pruning alike,
    with one warning naming it; its name alone (epoch 3) never wins."""
    for epochs in (1, 2, 3):
        write(tmp_path, checkpoint_name(epochs), epochs)
    cut_short(str(tmp_path / checkpoint_name(3) / "checkpoint.pt"))
    assert latest_progress(str(tmp_path)) == (2, 0)
    assert latest_checkpoint(str(tmp_path)).epochs_completed == 2
    warnings = capsys.readouterr().err.strip().splitlines()
    assert warnings == [
        f"[raypar] warning: skipping checkpoint {tmp_path / checkpoint_name(3)}: its checkpoint.pt is incomplete "
        "(cut short while it was written)"
    ]
    # The run fell back to epoch 2 and wrote epoch 3 anew... or, after a fall-back to scratch, epoch 1:
    # pruning keeps what it just wrote, whatever a newer name cut short says.
    shutil.rmtree(tmp_path / checkpoint_name(2))
    prune_checkpoints(str(tmp_path), 1)
    assert (tmp_path / checkpoint_name(1)).exists()


def test_a_storage_error_is_retried_then_named_not_taken_for_a_bad_checkpoint(tmp_path, monkeypatch):
    from ray_jobs.core import checkpoint

    write(tmp_path, checkpoint_name(1), 1)
    monkeypatch.setattr(checkpoint, "READ_RETRY_S", 0.0)
    real, failures = checkpoint.read_checkpoint, []

    def flaky(directory):
        if len(failures) < 2:
            failures.append(directory)
            raise OSError("AWS Error NETWORK_CONNECTION during GetObject")
        return real(directory)

    monkeypatch.setattr(checkpoint, "read_checkpoint", flaky)
    assert latest_checkpoint(str(tmp_path)).epochs_completed == 1 and len(failures) == 2
    failures.clear()
    monkeypatch.setattr(checkpoint, "READ_ATTEMPTS", 2)
    try:
        latest_checkpoint(str(tmp_path))
    except OSError as error:
        assert str(error) == (
            f"{tmp_path / checkpoint_name(1)}: checkpoint unreadable: AWS Error NETWORK_CONNECTION during GetObject"
        )
    else:
        raise AssertionError("a storage error was taken for a missing checkpoint")


def test_a_sharded_fsdp_checkpoint_is_refused_by_strategies_that_read_whole_weights():
    from ray_jobs.core.checkpoint import TrainState, slice_state

    state = TrainState({}, {}, 2, sharded=True)
    with pytest.raises(ValueError, match="written by fsdp.*resume this run with python -m ray_jobs.fsdp"):
        slice_state(state, {"net1.weight"}, 0, 2)


def write_sharded(run_dir, epochs: int, num_ranks: int = 2) -> str:
    """An fsdp checkpoint as the ranks leave it: ``checkpoint.pt`` without tensors, and ``shards/``
    with one DCP file per rank, each named in ``.metadata`` with its extent. One process writes
    rank 0's file; the others are its copies, entered in the metadata as DCP enters a rank's."""
    import warnings

    import torch.distributed.checkpoint as dcp

    directory = run_dir / checkpoint_name(epochs)
    write_checkpoint(str(directory), TrainState({}, {}, epochs, [1.0] * epochs, sharded=True))
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(64)}}, storage_writer=dcp.FileSystemWriter(str(directory / "shards")))
    shards = directory / "shards"
    for rank in range(1, num_ranks):  # the other ranks' files, named in the metadata as DCP would
        shutil.copy(shards / "__0_0.distcp", shards / f"__{rank}_0.distcp")
    metadata = torch.distributed.checkpoint.FileSystemReader(str(shards)).read_metadata()
    for index, info in list(metadata.storage_data.items()):
        for rank in range(1, num_ranks):
            metadata.storage_data[dataclasses.replace(index, fqn=f"{index.fqn}.{rank}")] = dataclasses.replace(
                info, relative_path=f"__{rank}_0.distcp"
            )
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    return str(shards)


def _slices(shards: str, ranks: list[int]) -> None:
    """A last checkpoint's ``weights/`` with only ``ranks``' slice files."""
    weights = Path(shards).parent / "weights"
    weights.mkdir()
    for rank in ranks:
        (weights / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors").write_bytes(b"")


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda shards: os.remove(f"{shards}/__1_0.distcp"), "its shards/__1_0.distcp is missing"),
        (lambda shards: os.truncate(f"{shards}/__1_0.distcp", 100), "its shards/__1_0.distcp (100 of"),
        (lambda shards: os.remove(f"{shards}/.metadata"), "its shards/.metadata is missing"),
        (lambda shards: os.truncate(f"{shards}/.metadata", 50), "its shards/.metadata does not load"),
        (lambda shards: _slices(shards, [0]), "its weights/shard-00002-*.safetensors is missing"),
    ],
    ids=["shard-missing", "shard-truncated", "metadata-missing", "metadata-truncated", "slice-missing"],
)
def test_an_fsdp_checkpoint_lacking_a_rank_shard_is_skipped_before_any_load(tmp_path, capsys, damage, why):
    """checkpoint.pt is whole, but a rank's shard never arrived (or arrived cut short): resume falls
    back to the previous whole checkpoint, with one warning naming what was missing."""
    write_sharded(tmp_path, 1)
    damage(write_sharded(tmp_path, 2))
    assert latest_progress(str(tmp_path)) == (1, 0)
    assert latest_checkpoint(str(tmp_path)).epochs_completed == 1
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert warning.startswith(f"[raypar] warning: skipping checkpoint {tmp_path / checkpoint_name(2)}: {why}")


def test_the_pipelines_background_writes_run_one_at_a_time_and_a_failure_names_its_checkpoint():
    import threading

    from ray_jobs.errors import TrainingFailed
    from ray_jobs.pipeline.checkpoint_writer import CheckpointWriter, snapshot

    writer, order, release = CheckpointWriter("async"), [], threading.Event()

    def slow() -> None:
        release.wait(10)
        order.append("first")

    writer.write("checkpoint_epoch_000001", slow, final=False, began=0.0)
    assert order == []  # the loop went on while it wrote
    release.set()
    writer.write("checkpoint_epoch_000002", lambda: order.append("second"), final=False, began=0.0)
    writer.write("checkpoint_epoch_000003", lambda: order.append("last"), final=True, began=0.0)
    assert order == ["first", "second", "last"]  # each waited for the one before; the last in sync

    def full() -> None:
        raise OSError("No space left on device")

    writer.write("checkpoint_epoch_000004", full, final=False, began=0.0)
    with pytest.raises(TrainingFailed, match="^checkpoint checkpoint_epoch_000004: its write failed: .*No space left"):
        writer.close()
    state = TrainState({}, {}, 1, [0.5])
    saved = snapshot(state)
    state.losses.append(0.4)
    assert saved.losses == [0.5]  # the loop's later appends are not in the checkpoint being written
