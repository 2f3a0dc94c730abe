"""``python -m ray_jobs.predict``: a run's model over new data with Ray Data, rows in input order."""

from __future__ import annotations

import pytest

from tests.helpers import predicts_the_model_in_input_order

pytestmark = pytest.mark.ray


def test_predictions_equal_the_model_in_input_order(ray_cluster, tmp_path):
    predicts_the_model_in_input_order(str(tmp_path), "", "regression", num_workers=1)
