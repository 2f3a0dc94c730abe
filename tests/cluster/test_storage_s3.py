"""Cloud storage for real: data, run storage and --init-from on moto's S3 server, with the
endpoint given in the URI's query or in AWS_ENDPOINT_URL."""

from __future__ import annotations

import io
import uuid

import pyarrow.fs as pafs
import pytest
import torch

from models import build_model
from ray_jobs.core.config import TrainConfig
from ray_jobs.data import storage
from ray_jobs.data.parquet import read_dataset, synthesize, write_table
from tests.helpers import assert_same_weights, reference_for, run_strategy, with_, write_parts


@pytest.fixture
def bucket(s3_endpoint) -> str:
    name = f"raypar-{uuid.uuid4().hex[:8]}"
    pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http", allow_bucket_creation=True).create_dir(name)
    return name


def upload(uri: str) -> None:
    """The session's regression_data, written to S3."""
    write_table(synthesize(96, 6, 3, "regression", seed=1), uri)


@pytest.mark.ray
def test_everything_through_a_uri_with_query_options(ray_cluster, s3_endpoint, bucket, regression_data):
    query = f"?endpoint_override={s3_endpoint}&scheme=http"
    data = f"s3://{bucket}/data/train.parquet{query}"
    upload(data)
    init = build_model("seed-mlp", 6, 3, hidden=8).state_dict()
    buffer = io.BytesIO()
    torch.save(init, buffer)
    storage.write_bytes(f"s3://{bucket}/init.pt{query}", buffer.getvalue())
    cfg = TrainConfig(
        model="seed-mlp",
        hidden=8,
        data=data,
        init_from=f"s3://{bucket}/init.pt{query}",
        epochs=2,
        batch_size=16,
        seed=4,
        storage_path=f"s3://{bucket}/runs{query}",
        name="query",
    )
    summary = run_strategy("ddp", cfg, num_workers=2)
    weights = torch.load(io.BytesIO(storage.read_bytes(storage.join(summary.run_dir, "model.pt"))), weights_only=True)
    assert_same_weights(weights, reference_for(with_(cfg, data=regression_data, init_from=None), init_state=init)[0])
    assert storage.exists(f"s3://{bucket}/runs/query/summary.json{query}")
    # TensorBoard's event file, written locally by world rank 0 and copied into the bucket each epoch
    assert storage.list_dir(f"s3://{bucket}/runs/query/tensorboard{query}")


@pytest.mark.ray
def test_the_endpoint_from_the_environment_reaches_the_workers(
    ray_cluster, s3_endpoint, bucket, monkeypatch, regression_data
):
    # Only the driver has AWS_ENDPOINT_URL: the shared cluster's workers started before it was set.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_endpoint}")
    data = f"s3://{bucket}/data/train.parquet"
    upload(data)
    assert read_dataset(data).num_rows == 96
    cfg = TrainConfig(
        model="seed-mlp",
        hidden=8,
        data=data,
        epochs=2,
        batch_size=16,
        seed=4,
        storage_path=f"s3://{bucket}/runs",
        name="env",
        max_failures=1,
    )
    summary = run_strategy("ddp", cfg, num_workers=2, crash_at_epoch=1)  # the restart reads the checkpoint from S3
    assert summary.resumed_from_epoch == 1
    weights = torch.load(io.BytesIO(storage.read_bytes(f"{summary.run_dir}/model.pt")), weights_only=True)
    assert_same_weights(weights, reference_for(with_(cfg, data=regression_data))[0])


@pytest.mark.ray
def test_streaming_from_a_bucket_and_resuming_mid_epoch_from_it(ray_cluster, s3_endpoint, bucket, tmp_path):
    query = f"?endpoint_override={s3_endpoint}&scheme=http"
    cfg = TrainConfig(
        model="seed-mlp",
        hidden=8,
        data=write_parts(f"s3://{bucket}/stream", query=query),
        ingest="stream",
        shuffle_window_rows=24,
        epochs=2,
        batch_size=16,
        seed=9,
        momentum=0.9,
        checkpoint_every_steps=2,
        max_failures=1,
        storage_path=f"s3://{bucket}/runs{query}",
        name="stream",
    )
    # The kill comes after the checkpoint at step 2 of epoch 1: the restart reads it from the bucket.
    summary = run_strategy("ddp", cfg, num_workers=2, crash_at_epoch=1, crash_at_step=3)
    assert (summary.resumed_from_epoch, summary.resumed_from_step, summary.ingest) == (1, 2, "stream")
    weights = torch.load(io.BytesIO(storage.read_bytes(storage.join(summary.run_dir, "model.pt"))), weights_only=True)
    local = with_(cfg, data=write_parts(tmp_path))  # the same files, locally, for the reference
    assert_same_weights(weights, reference_for(local)[0])
