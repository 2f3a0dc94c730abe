"""A storage that fills up mid-run: one ``error:`` line naming the run directory and the cause, no
traceback on the terminal, nothing a resume could trust half-written; once there is room again,
a re-run resumes and ends on the uninterrupted run's weights."""

from __future__ import annotations

import subprocess

import pytest

from ray_jobs import ddp
from ray_jobs.core.config import TrainConfig
from tests.helpers import assert_same_weights, load_weights, reference_for

pytestmark = pytest.mark.ray


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: room for one checkpoint of the model below (2.6 MB), not two."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_is_one_line_and_a_rerun_with_room_ends_on_the_reference(
    ray_cluster, small_disk, regression_data, capsys, mode
):
    """async: the write that fails runs in Ray Train's upload thread while training goes on; the next
    checkpoint stops it. Whichever write fails first (ours, or Ray Train's own registry file on the
    same full disk) is the one line."""
    cfg = TrainConfig(
        model="mlp",
        hidden=400,
        data=regression_data,
        epochs=3,
        batch_size=16,
        seed=5,
        momentum=0.9,
        storage_path=str(small_disk),
        name="run",
    )
    argv = [
        "--model",
        "mlp",
        "--hidden",
        "400",
        "--data",
        regression_data,
        "--epochs",
        "3",
        "--batch-size",
        "16",
        "--seed",
        "5",
        "--momentum",
        "0.9",
        "--storage-path",
        str(small_disk),
        "--name",
        "run",
        "--checkpoint-mode",
        mode,
    ]
    assert ddp.main(argv) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [f"error: training failed: {errors[0].split('training failed: ', 1)[1]}"], err
    assert "No space left on device" in errors[0] and f"{small_disk / 'run'}" in errors[0]
    assert "Traceback" not in err
    assert not (small_disk / "run" / "model.pt").exists()
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # room again
    assert ddp.main(argv) == 0
    out = capsys.readouterr()
    assert "resuming from the checkpoint after epoch 1" in out.out
    assert_same_weights(load_weights(str(small_disk / "run")), reference_for(cfg)[0])
