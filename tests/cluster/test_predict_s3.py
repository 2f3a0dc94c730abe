"""``python -m ray_jobs.predict`` from and to a bucket (moto's S3 on loopback), two actors."""

from __future__ import annotations

import uuid

import pyarrow.fs as pafs
import pytest

from tests.helpers import predicts_the_model_in_input_order

pytestmark = pytest.mark.ray


def test_predictions_from_a_bucket_equal_the_model_in_input_order(ray_cluster, s3_endpoint):
    bucket = f"raypar-{uuid.uuid4().hex[:8]}"
    pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http", allow_bucket_creation=True).create_dir(bucket)
    predicts_the_model_in_input_order(
        f"s3://{bucket}", f"?endpoint_override={s3_endpoint}&scheme=http", "classification", num_workers=2
    )
