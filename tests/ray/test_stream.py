"""Streaming ingest on Ray: every strategy trains the single-process reference's weights in order
contract v2's order, a resume mid-epoch ends the same, and bad rows stop the run naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ray_jobs.core.config import TrainConfig
from ray_jobs.data import stream
from ray_jobs.data.parquet import synthesize, write_table
from ray_jobs.driver.prepare import prepare
from ray_jobs.errors import Failure, TrainingFailed
from ray_jobs.pipeline.scaling import PipelineScaling
from tests.helpers import (
    assert_trains_the_reference,
    plain_validation,
    reference_for,
    run_strategy,
    tensors,
    with_,
    write_parts,
)


@pytest.fixture
def cfg(stream_cfg) -> TrainConfig:
    return stream_cfg


@pytest.mark.ray
@pytest.mark.parametrize(
    ("strategy", "options", "shuffle", "task"),
    [
        ("ddp", {"num_workers": 2}, True, "regression"),
        ("ddp", {"num_workers": 2}, False, "classification"),
        ("dp", {}, True, "regression"),
        (
            "pipeline",
            {"scaling": PipelineScaling(num_stages=2, num_microbatches=4, schedule="gpipe")},
            True,
            "regression",
        ),
        (
            "pipeline",
            {"scaling": PipelineScaling(num_stages=2, num_microbatches=2, schedule="1f1b")},
            False,
            "regression",
        ),
    ],
)
def test_streaming_trains_the_reference_weights(ray_cluster, cfg, tmp_path, strategy, options, shuffle, task):
    """The validation set streams too: 30 rows in row groups of 7, the same numbers as plain PyTorch."""
    val_data = str(tmp_path / "val.parquet")
    write_table(synthesize(30, 6, 4 if task == "classification" else 3, task, seed=4), val_data, row_group_rows=7)
    cfg = with_(cfg, shuffle=shuffle, val_data=val_data)
    if task == "classification":
        (tmp_path / "labels").mkdir()
        cfg = with_(cfg, data=write_parts(tmp_path / "labels", "classification"))
    summary = run_strategy(strategy, cfg, **options)
    # as in memory: the gradient's summation order differs from one full-batch mean
    assert_trains_the_reference(summary, cfg)
    record = json.loads(open(f"{summary.run_dir}/summary.json").read())
    assert record["ingest"] == "stream" and record["resumed_from_step"] is None
    file_bytes = sum(f.stat().st_size for f in Path(cfg.data).glob("*.parquet"))
    assert 0 < record["bytes_read"] <= cfg.epochs * file_bytes  # each row group once per epoch
    assert 0 <= record["data_wait_fraction"] < 1
    val_x, val_y, _ = tensors(val_data)
    expected_val = [
        plain_validation(record["model"], reference_for(with_(cfg, epochs=epoch))[0], val_x, val_y)
        for epoch in range(1, cfg.epochs + 1)
    ]
    # float32 whole-set mean vs float64 chunk sums, of weights equal to float tolerance
    assert record["val_losses"] == pytest.approx([loss for loss, _ in expected_val], rel=1e-5)


@pytest.mark.ray
@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_a_kill_after_a_mid_epoch_checkpoint_resumes_at_that_step(ray_cluster, cfg, strategy):
    options = {"num_workers": 2} if strategy == "ddp" else {"scaling": PipelineScaling(num_stages=2)}
    cfg = with_(cfg, checkpoint_every_steps=2, max_failures=1)
    # 7 global batches an epoch: checkpoints after steps 2, 4 and 6; the kill comes after step 3.
    summary = run_strategy(strategy, cfg, crash_at_epoch=1, crash_at_step=3, **options)
    assert (summary.resumed_from_epoch, summary.resumed_from_step) == (1, 2)
    assert_trains_the_reference(summary, cfg)


@pytest.mark.ray
def test_bad_rows_stop_the_run_at_their_window_naming_file_and_row_group(ray_cluster, cfg, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    write_parts(bad)
    table = pq.read_table(bad / "part-2.parquet")
    features = table.column("features").to_pylist()
    features[12][0] = float("nan")  # row group 2 of part-2
    write_table(
        table.set_column(0, "features", pa.array(features, table.schema.field("features").type)),
        str(bad / "part-2.parquet"),
        row_group_rows=5,
    )
    with pytest.raises(TrainingFailed, match=r"part-2.parquet row group 2: column 'features' has NaN"):
        run_strategy("ddp", with_(cfg, data=str(bad), shuffle=False, checkpoint_every_steps=2), num_workers=2)
    assert list((tmp_path / "run").glob("checkpoint_epoch_000000_step_*"))  # the last good one is kept


@pytest.mark.ray
def test_a_reader_that_never_delivers_is_one_line_not_a_hang(ray_cluster, stream_cfg, monkeypatch):
    """A worker waits for a window at most ``READER_TIMEOUT_S``, then fails naming what it waited for."""
    import ray

    from ray_jobs.data.stream import StreamSource

    @ray.remote(num_cpus=0)
    class StuckReader:
        def window(self, epoch, index):
            import time

            time.sleep(60)

    monkeypatch.setattr(stream, "READER_TIMEOUT_S", 0.5)
    dataset = prepare(stream_cfg, "ddp").dataset
    reader = StuckReader.remote()
    source = StreamSource(dataset, reader, stream_cfg.seed, stream_cfg.shuffle)
    with pytest.raises(Failure, match=r"the stream's reader did not deliver window 0 of epoch 1 within 0.5 s"):
        source.rows(torch.arange(4))
    ray.kill(reader)
