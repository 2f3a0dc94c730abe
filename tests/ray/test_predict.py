"""``python -m ray_jobs.predict``: a run's model over new data with Ray Data, rows in input order."""

from __future__ import annotations

import pytest

from ray_jobs.predict import job as predict
from tests.helpers import fake_run, predicts_the_model_in_input_order, write_parts

pytestmark = pytest.mark.ray


def test_predictions_equal_the_model_in_input_order(ray_cluster, tmp_path):
    predicts_the_model_in_input_order(str(tmp_path), "", "regression", num_workers=1)


# The session's Ray has 4 CPUs: a pool of 1-CPU actors as large as that (or larger) held every
# CPU, Ray Data's reads never ran, and predict waited forever (killed after 150 s here).
@pytest.mark.parametrize("num_workers", [4, 5])
def test_a_pool_as_large_as_the_cluster_still_leaves_reads_a_cpu(ray_cluster, tmp_path, num_workers):
    predicts_the_model_in_input_order(str(tmp_path), "", "classification", num_workers=num_workers)


def test_a_pool_that_cannot_start_ends_in_one_line_not_a_hang(ray_cluster, tmp_path, capsys):
    """--use-gpu on a cluster of no GPUs: the actors never start; the stall timeout ends the wait."""
    data = write_parts(str(tmp_path / "new"))
    fake_run(str(tmp_path / "run"), "regression")
    argv = ["--run-dir", str(tmp_path / "run"), "--data", data, "--out", str(tmp_path / "pred.parquet")]
    assert predict.main([*argv, "--use-gpu", "--stall-timeout-s", "5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: prediction failed: no predictions for 5 s (--stall-timeout-s)"), err
    assert not (tmp_path / "pred.parquet").exists()
