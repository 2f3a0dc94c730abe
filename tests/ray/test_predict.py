"""``python -m ray_jobs.predict``: a run's model over new data with Ray Data, rows in input order."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.data

from ray_jobs.predict import job as predict
from tests.helpers import fake_run, predicts_the_model_in_input_order, write_parts

pytestmark = pytest.mark.ray


def test_predictions_equal_the_model_in_input_order(ray_cluster, tmp_path):
    """Also: the read of its 3 files starts one footer reader, not Ray Data's 32 processes."""
    from ray.util.state import list_actors

    def footer_readers() -> int:
        filters = [("class_name", "=", "FooterReader")]  # dead ones too: the read's pool is gone
        return len(list_actors(address=ray_cluster.dashboard_url, filters=filters, limit=10_000))

    before = footer_readers()
    predicts_the_model_in_input_order(str(tmp_path), "", "regression", num_workers=1)
    assert footer_readers() - before == 1


# The session's Ray has 4 CPUs: a pool of 1-CPU actors as large as that (or larger) held every
# CPU, Ray Data's reads never ran, and predict waited forever (killed after 150 s here). A pool
# exactly as large gets the same fractional CPUs (split_cpus, tests/unit/test_predict.py).
def test_a_pool_larger_than_the_cluster_still_leaves_reads_a_cpu(ray_cluster, tmp_path):
    predicts_the_model_in_input_order(str(tmp_path), "", "classification", num_workers=5)


def test_a_pool_that_cannot_start_ends_in_one_line_not_a_hang(ray_cluster, tmp_path, capsys):
    """--use-gpu on a cluster of no GPUs: the actors never start; the stall timeout ends the wait."""
    data = write_parts(str(tmp_path / "new"))
    fake_run(str(tmp_path / "run"), "regression")
    argv = ["--run-dir", str(tmp_path / "run"), "--data", data, "--out", str(tmp_path / "pred.parquet")]
    assert predict.main([*argv, "--use-gpu", "--stall-timeout-s", "5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: prediction failed: no predictions for 5 s (--stall-timeout-s)"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "run"]  # no pred.parquet, no .partial
    # predict's settings stay in its own context: the session's other datasets keep Ray Data's defaults
    assert ray.data.DataContext.get_current().execution_no_progress_timeout_s != 5


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_an_input_of_no_rows_writes_a_valid_empty_file_with_the_output_columns(ray_cluster, tmp_path, task):
    """0 rows in, 0 rows out: a valid Parquet file with the input's columns and the prediction's
    (it was a 0-byte file that nothing could read)."""
    fake_run(str(tmp_path / "run"), task)
    schema = pa.schema([pa.field("features", pa.list_(pa.float32())), pa.field("target", pa.list_(pa.float32()))])
    pq.write_table(schema.empty_table(), tmp_path / "empty.parquet")
    argv = ["--run-dir", str(tmp_path / "run"), "--data", str(tmp_path / "empty.parquet")]
    assert predict.main([*argv, "--out", str(tmp_path / "pred.parquet")]) == 0
    table = pq.read_table(tmp_path / "pred.parquet")
    appended = ["prediction", "probabilities"] if task == "classification" else ["prediction"]
    assert table.num_rows == 0 and table.column_names == ["features", "target", *appended]
    prediction_type = pa.int64() if task == "classification" else pa.list_(pa.float32())
    assert table.schema.field("prediction").type == prediction_type
