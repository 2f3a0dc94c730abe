"""Parquet data: round trip, synthetic sets, and one clear error per kind of bad input."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_jobs.data.__main__ import main as data_main
from ray_jobs.data.parquet import read_dataset, synthesize, table_to_dataset, write_table


def test_synth_regression_round_trip(tmp_path):
    path = str(tmp_path / "nested" / "r.parquet")
    table = synthesize(50, 7, 3, "regression", seed=4)
    write_table(table, path)
    dataset = read_dataset(path)
    assert (dataset.task, dataset.num_rows, dataset.in_features, dataset.out_features) == ("regression", 50, 7, 3)
    assert dataset.features.dtype == np.float32 and dataset.targets.shape == (50, 3)
    np.testing.assert_array_equal(dataset.features.ravel(), table.column("features").combine_chunks().flatten())


def test_synth_is_seeded_and_learnable():
    first, second = synthesize(20, 4, 2, seed=1), synthesize(20, 4, 2, seed=1)
    assert first.equals(second)
    assert not first.equals(synthesize(20, 4, 2, seed=2))
    dataset = table_to_dataset(first)
    # Targets are a linear map of the inputs plus small noise: least squares recovers them.
    x = np.c_[dataset.features, np.ones(20)]
    solution, *_ = np.linalg.lstsq(x, dataset.targets, rcond=None)
    assert np.abs(x @ solution - dataset.targets).max() < 0.05


def test_classification_keeps_declared_class_count(tmp_path):
    path = str(tmp_path / "c.parquet")
    write_table(synthesize(5, 3, 9, "classification", seed=0), path)  # 5 rows cannot show all 9 labels
    dataset = read_dataset(path)
    assert dataset.task == "classification" and dataset.out_features == 9 and dataset.targets.dtype == np.int64


def test_directory_of_files_and_variable_length_lists(tmp_path):
    rows = {"features": [[1.0, 2.0], [3.0, 4.0]], "target": [[0.5], [1.5]]}
    pq.write_table(pa.table(rows), tmp_path / "part-0.parquet")
    pq.write_table(pa.table(rows), tmp_path / "part-1.parquet")
    dataset = read_dataset(str(tmp_path))
    assert dataset.num_rows == 4 and dataset.in_features == 2 and dataset.out_features == 1


def test_custom_column_names(tmp_path):
    pq.write_table(pa.table({"x": [[1.0, 2.0]], "label": pa.array([1], pa.int32())}), tmp_path / "d.parquet")
    dataset = read_dataset(str(tmp_path / "d.parquet"), feature_column="x", target_column="label")
    assert dataset.task == "classification" and dataset.out_features == 2


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (
            {"feats": [[1.0]], "target": [[1.0]]},
            "column 'features' (--feature-column) is missing; the data has columns: feats, target",
        ),
        ({"features": [[1.0]], "y": [[1.0]]}, "column 'target' (--target-column) is missing"),
        (
            {"features": [[1.0, 2.0], [1.0]], "target": [[1.0], [2.0]]},
            "column 'features' is ragged: row 0 has 2 values, row 1 has 1",
        ),
        (
            {"features": [1.0, 2.0], "target": [[1.0], [2.0]]},
            "column 'features' must be a list of floats per row, got double",
        ),
        ({"features": [["a"]], "target": [[1.0]]}, "column 'features' must hold numbers"),
        ({"features": [[1.0]], "target": ["a"]}, "column 'target' must be a list of floats (regression) or integers"),
        ({"features": [[1.0]], "target": [-1]}, "negative class labels"),
        ({"features": [[1.0], None], "target": [[1.0], [2.0]]}, "column 'features' has 1 null rows"),
        ({"features": [[]], "target": [[1.0]]}, "column 'features' has empty lists"),
        (
            {"features": [[1.0], [float("nan")]], "target": [[1.0], [2.0]]},
            "column 'features' has NaN or infinite values (first at row 1)",
        ),
        ({"features": [[1.0]], "target": [[float("inf")]]}, "column 'target' has NaN or infinite values"),
    ],
)
def test_bad_columns_are_one_line_errors(columns, message):
    with pytest.raises(ValueError) as error:
        table_to_dataset(pa.table(columns))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="the dataset has no rows"):
        table_to_dataset(
            pa.table({"features": pa.array([], pa.list_(pa.float32())), "target": pa.array([], pa.int64())})
        )


def test_missing_and_unreadable_paths(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        read_dataset(str(tmp_path / "absent.parquet"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not readable as Parquet"):
        read_dataset(str(tmp_path / "junk.parquet"))


def test_synth_cli(tmp_path, capsys):
    out = str(tmp_path / "s.parquet")
    assert (
        data_main(
            [
                "synth",
                "--out",
                out,
                "--rows",
                "12",
                "--in-features",
                "3",
                "--out-features",
                "2",
                "--task",
                "classification",
                "--seed",
                "5",
            ]
        )
        == 0
    )
    assert read_dataset(out).num_rows == 12
    assert data_main(["synth", "--out", out, "--task", "ranking"]) == 2
    assert "error: --task 'ranking' is unknown" in capsys.readouterr().err


def labels_table(labels: list[int], num_classes: int | None = None) -> pa.Table:
    metadata = {b"raypar.num_classes": str(num_classes).encode()} if num_classes else None
    return pa.table(
        {"features": [[float(v)] for v in labels], "target": pa.array(labels, pa.int64())}, metadata=metadata
    )


def test_num_classes_states_a_class_the_split_lacks():
    dataset = table_to_dataset(labels_table([0, 1, 1]), num_classes=4)  # the training split lacks class 3
    assert dataset.out_features == 4 and "4 classes from --num-classes" in dataset.reason
    auto = table_to_dataset(labels_table([0, 1, 1]))
    assert auto.out_features == 2 and "the largest label + 1 (state --num-classes" in auto.reason
    with pytest.raises(ValueError, match=r"label 5 >= num_classes 4 \(--num-classes\)"):
        table_to_dataset(labels_table([0, 5]), num_classes=4)
    with pytest.raises(ValueError, match="--num-classes 4 disagrees with the data's raypar.num_classes 6"):
        table_to_dataset(labels_table([0, 1], num_classes=6), num_classes=4)


def test_num_classes_is_read_from_every_file_of_a_directory(tmp_path):
    pq.write_table(labels_table([0, 1]), tmp_path / "part-0.parquet")  # no metadata in the first file
    pq.write_table(labels_table([1, 2], num_classes=5), tmp_path / "part-1.parquet")
    assert read_dataset(str(tmp_path)).out_features == 5
    pq.write_table(labels_table([0], num_classes=7), tmp_path / "part-2.parquet")
    with pytest.raises(
        ValueError, match=r"disagree on raypar.num_classes: .*part-1.parquet says 5, .*part-2.parquet says 7"
    ):
        read_dataset(str(tmp_path))


def test_task_says_what_an_integer_or_float_target_is():
    regression = table_to_dataset(labels_table([0, 3, 7]), task="regression")
    assert regression.task == "regression" and regression.targets.tolist() == [[0.0], [3.0], [7.0]]
    assert "--task regression" in regression.reason
    assert table_to_dataset(labels_table([0, 3]), task="auto").task == "classification"
    floats = table_to_dataset(pa.table({"features": [[1.0], [2.0]], "target": [0.5, 1.5]}))
    assert floats.task == "regression" and floats.targets.shape == (2, 1)
    with pytest.raises(ValueError, match="--task classification needs an integer column of class labels"):
        table_to_dataset(pa.table({"features": [[1.0]], "target": [[0.5]]}), task="classification")
    with pytest.raises(ValueError, match="--num-classes applies to classification"):
        table_to_dataset(pa.table({"features": [[1.0]], "target": [[0.5]]}), num_classes=3)


def test_a_directory_is_read_for_its_parquet_files_only(tmp_path):
    data = tmp_path / "data"
    write_table(synthesize(8, 3, 2, "regression", seed=0), str(data / "part-0.parquet"))
    write_table(synthesize(5, 3, 2, "regression", seed=1), str(data / "pred.parquet.partial"))  # a write cut short
    (data / "notes.txt").write_text("not data")
    (data / "_SUCCESS").write_text("")
    assert read_dataset(str(data)).num_rows == 8
