"""Batch prediction with a trained run's model: Ray Data reads the Parquet input, an actor pool
applies the model (each actor loads it once), and the driver writes the rows in input order.

Everything that can be checked without Ray (the run, its model, the input's columns and width)
is checked in ``trained.load_run`` and ``check_input``, so bad input costs a second and one line.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from ray_jobs.data import storage
from ray_jobs.data.parquet import fixed_width, parquet_files
from ray_jobs.predict.trained import TrainedModel


def check_input(path: str, feature_column: str, in_features: int) -> tuple[pafs.FileSystem, list[str]]:
    """The input's files in name order (the output's row order), after checking the first row's width."""
    filesystem, fs_path = storage.resolve(path)
    if filesystem.get_file_info(fs_path).type == pafs.FileType.NotFound:
        raise ValueError(f"--data {path}: no such file or directory")
    files = parquet_files(filesystem, fs_path)
    if not files:
        raise ValueError(f"--data {path}: no Parquet files")
    try:
        first = pq.ParquetFile(filesystem.open_input_file(files[0]))
        names = first.schema_arrow.names
        if feature_column not in names:
            raise ValueError(
                f"--data {path}: no column {feature_column!r} (--feature-column); it has {', '.join(names)}"
            )
        sample = first.read_row_group(0, columns=[feature_column]).slice(0, 1) if first.num_row_groups else None
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"--data {path}: not readable as Parquet ({str(error).splitlines()[0]})") from None
    if sample is not None and len(sample):
        width = fixed_width(sample.column(feature_column), feature_column).shape[1]
        if width != in_features:
            raise ValueError(f"--data {path} has {width} features per row; the model takes {in_features}")
    return filesystem, files


class Predictor:
    """One actor of the pool: loads the model once, then appends predictions to each batch."""

    def __init__(self, trained: TrainedModel, feature_column: str, use_gpu: bool) -> None:
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model, self.task, self.feature_column = trained.load(self.device), trained.task, feature_column

    def __call__(self, batch: pa.Table) -> pa.Table:
        features = torch.from_numpy(fixed_width(batch.column(self.feature_column), self.feature_column))
        with torch.no_grad():
            out = self.model(features.to(self.device)).float().cpu()
        if self.task == "classification":
            probabilities = torch.softmax(out, dim=1).numpy()
            batch = batch.append_column("prediction", pa.array(out.argmax(dim=1).numpy()))
            return batch.append_column("probabilities", _lists(probabilities))
        return batch.append_column("prediction", _lists(out.numpy()))


def _lists(matrix: np.ndarray) -> pa.Array:
    """An (n, k) float32 matrix as a list<float> column."""
    return pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), matrix.shape[1]).cast(pa.list_(pa.float32()))


def predict(
    trained: TrainedModel,
    filesystem: pafs.FileSystem,
    files: list[str],
    out: str,
    feature_column: str,
    batch_size: int,
    num_workers: int,
    use_gpu: bool,
) -> int:
    """Run the actor pool over ``files`` and write ``out``; returns the rows written. Ray must be connected."""
    import ray.data

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # output rows in input order
    context.enable_progress_bars = False  # raypar prints its own one line
    dataset = ray.data.read_parquet(files, filesystem=filesystem).map_batches(
        Predictor,
        fn_constructor_kwargs={"trained": trained, "feature_column": feature_column, "use_gpu": use_gpu},
        batch_format="pyarrow",
        batch_size=batch_size,
        concurrency=num_workers,
        num_gpus=1 if use_gpu else 0,
    )
    rows = 0

    def write(stream) -> None:
        nonlocal rows
        writer = None
        for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
            if writer is None:
                writer = pq.ParquetWriter(stream, batch.schema)
            writer.write_table(batch)
            rows += batch.num_rows
        if writer is not None:
            writer.close()

    storage.write(out, write)
    return rows
