"""``python -m ray_jobs.predict``: a run's model over new data with Ray Data, rows in input order."""
from __future__ import annotations

import io
import json
import uuid

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from models import build_model
from ray_jobs import predict, storage
from ray_jobs.data import read_dataset
from tests.helpers import write_parts


def fake_run(run_dir: str, task: str) -> torch.nn.Module:
    """A finished run's directory as the trainer leaves it (summary.json, model.pt, best_model.pt),
    without training: prediction only reads these. Returns the final model."""
    record = {"name": "seed-mlp", "in_features": 6, "out_features": 4 if task == "classification" else 3, "hidden": 8}
    models = {}
    for index, name in enumerate(("model.pt", "best_model.pt")):
        torch.manual_seed(index)
        models[name] = build_model(**record)
        buffer = io.BytesIO()
        torch.save(models[name].state_dict(), buffer)
        storage.write_bytes(storage.join(run_dir, name), buffer.getvalue())
    storage.write_bytes(storage.join(run_dir, "summary.json"),
                        json.dumps({"model": record, "task": task, "config": {}}).encode())
    return models["model.pt"]


def expected_predictions(model: torch.nn.Module, data_dir: str) -> torch.Tensor:
    """``model(x)`` from a plain ``torch.load``, the rows in input order (files in name order)."""
    features = torch.from_numpy(read_dataset(data_dir).features.copy())
    with torch.no_grad():
        return model(features)


@pytest.mark.ray
@pytest.mark.parametrize(("task", "num_workers", "where"), [("regression", 1, "local"), ("classification", 2, "s3")])
def test_predictions_equal_the_model_in_input_order(ray_cluster, request, tmp_path, task, num_workers, where):
    if where == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = f"raypar-{uuid.uuid4().hex[:8]}"
        pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True).create_dir(bucket)
        base, query = f"s3://{bucket}", f"?endpoint_override={endpoint}&scheme=http"
    else:
        base, query = str(tmp_path), ""
    data_dir = write_parts(f"{base}/new", task, query)  # 3 files, uneven row groups: 120 rows
    run_dir, out = f"{base}/runs/run{query}", f"{base}/pred.parquet{query}"
    model = fake_run(run_dir, task)
    argv = ["--run-dir", run_dir, "--data", data_dir, "--out", out, "--batch-size", "16",
            "--num-workers", str(num_workers)]
    assert predict.main(argv) == 0
    filesystem, path = storage.resolve(out)
    table = pq.read_table(path, filesystem=filesystem)
    data = read_dataset(data_dir)
    expected = expected_predictions(model, data_dir)
    assert table.column_names[:2] == ["features", "target"]  # every input column kept
    torch.testing.assert_close(torch.tensor(table.column("features").to_pylist()), torch.from_numpy(data.features))
    if task == "classification":
        assert table.column("prediction").to_pylist() == expected.argmax(dim=1).tolist()
        probabilities = torch.tensor(table.column("probabilities").to_pylist())
        # the same float32 model on the same rows; only the batch cut differs (matmul rounding)
        torch.testing.assert_close(probabilities, torch.softmax(expected, dim=1), rtol=1e-5, atol=1e-6)
        assert table.column("target").to_pylist() == data.targets.tolist()
    else:
        torch.testing.assert_close(torch.tensor(table.column("prediction").to_pylist()), expected, rtol=1e-5, atol=1e-6)


def test_bad_input_is_one_error_line(tmp_path, capsys, regression_data):
    fake_run(str(tmp_path / "run"), "classification")
    (tmp_path / "empty").mkdir()
    cases = [
        (["--run-dir", str(tmp_path / "empty")], f"error: --run-dir {tmp_path / 'empty'} has no summary.json"),
        (["--run-dir", str(tmp_path / "run"), "--data", str(tmp_path / "none.parquet")], "no such file or directory"),
        (["--run-dir", str(tmp_path / "run"), "--checkpoint", "last"], "error: --checkpoint 'last' is unknown"),
        (["--data", regression_data], "error: --run-dir is required"),
    ]
    (tmp_path / "run" / "best_model.pt").unlink()
    cases.append((["--run-dir", str(tmp_path / "run"), "--checkpoint", "best"],
                  f"error: --run-dir {tmp_path / 'run'} has no best_model.pt (the run had no --val-data)"))
    for argv, message in cases:
        full = {"--run-dir": str(tmp_path / "run"), "--data": regression_data, "--out": str(tmp_path / "o.parquet")}
        full.update(dict(zip(argv[::2], argv[1::2])))
        if argv == ["--data", regression_data]:
            full.pop("--run-dir")
        assert predict.main([item for pair in full.items() for item in pair]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
    # the width check: a 4-class model's run reads 6 features; a file of 5 per row is refused
    from ray_jobs.data import synthesize, write_table

    write_table(synthesize(8, 5, 3, "regression", seed=0), str(tmp_path / "five.parquet"))
    assert predict.main(["--run-dir", str(tmp_path / "run"), "--data", str(tmp_path / "five.parquet"),
                         "--out", str(tmp_path / "o.parquet")]) == 2
    assert "has 5 features per row; the model takes 6" in capsys.readouterr().err
    assert not (tmp_path / "o.parquet").exists()
