"""Batch prediction with a trained run's model: Ray Data reads the Parquet input, an actor pool
applies the model (each actor loads it once), and the driver writes the rows in input order.

Everything that can be checked without Ray (the run and its model in ``trained``; here the
input's columns and width, and where the output goes) is checked before Ray starts, so bad input
costs a second and one line.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from ray_jobs.data import storage
from ray_jobs.data.parquet import fixed_width, parquet_files
from ray_jobs.driver.connect import env_defaults
from ray_jobs.predict.trained import TrainedModel

# Ray Data's read tasks take this many CPUs each (its default); the actor pool leaves them free.
READ_CPUS = 1.0
# Ray schedules resources in steps of 1/10,000: an actor's share is rounded down to one.
CPU_STEPS = 10_000
# Ray Data 2.60 reads Parquet footers on a pool of actors it sizes when a read_parquet is planned:
# 32 of them unless this is set, each a worker process of its own, for one file or a thousand;
# each reader is handed files in batches (the second variable, 10 unless set). With its 32, three
# reads of one small file started 17 worker processes and took 8.4 s here; with one reader, 4
# processes and 4.3 s.
FOOTER_READERS_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
FOOTER_BATCH_ENV = "RAY_DATA_PARQUET_FOOTER_BATCH_SIZE"
MAX_FOOTER_READERS = 32


class PredictFailed(RuntimeError):
    """Prediction stopped after Ray started; the message is one line."""


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


def check_output(out: str, data: str) -> storage.Location:
    """``out``, resolved, once it is a place to write a new file that training will not read as data."""
    out_fs, out_path = _real(out)
    data_fs, data_path = _real(data)
    same_store = out_fs.type_name == data_fs.type_name
    if same_store and out_path == data_path:
        raise ValueError(f"--out {out} is --data itself: name a new file, the input stays as it is")
    # A directory of data is what a later `--data DIR` training run reads, every Parquet file
    # under it: predictions written there would become training rows. Beside a single --data file
    # is fine: that file alone is the data.
    data_is_dir = data_fs.get_file_info(data_path).type == pafs.FileType.Directory
    if same_store and data_is_dir and out_path.startswith(data_path.rstrip("/") + "/"):
        raise ValueError(
            f"--out {out} is inside --data's directory {data}: training on that directory would read "
            "the predictions as data; write them elsewhere"
        )
    if out_fs.get_file_info(out_path).type == pafs.FileType.Directory:
        raise ValueError(f"--out {out} is a directory: name the Parquet file to write (e.g. {out}/predictions.parquet)")
    parent = out_path.rstrip("/").rpartition("/")[0]
    if parent and out_fs.get_file_info(parent).type == pafs.FileType.File:
        raise ValueError(f"--out {out}: {parent} is a file, not a directory to write into")
    return storage.locate(out)


def _real(target: str) -> tuple[pafs.FileSystem, str]:
    """A path as the filesystem sees it; a local one with its symlinks followed, so two names of
    one file compare equal."""
    filesystem, path = storage.resolve(target)
    return (filesystem, os.path.realpath(path)) if isinstance(filesystem, pafs.LocalFileSystem) else (filesystem, path)


def prediction_fields(task: str) -> list[pa.Field]:
    """The columns prediction appends to the input's: the one place their names and types are set."""
    if task == "classification":
        return [pa.field("prediction", pa.int64()), pa.field("probabilities", pa.list_(pa.float32()))]
    return [pa.field("prediction", pa.list_(pa.float32()))]


def output_schema(input_schema: pa.Schema, task: str) -> pa.Schema:
    for appended in prediction_fields(task):
        input_schema = input_schema.append(appended)
    return input_schema


class Predictor:
    """One actor of the pool: loads the model once, then appends predictions to each batch."""

    def __init__(self, trained: TrainedModel, feature_column: str, use_gpu: bool) -> None:
        # One thread: an actor holds at most one CPU's share (``split_cpus``), and torch's default
        # of a thread per core would have every actor of the pool contend for every core.
        torch.set_num_threads(1)
        self.device = torch.device("cuda" if use_gpu else "cpu")
        self.model, self.task, self.feature_column = trained.load(self.device), trained.task, feature_column

    def __call__(self, batch: pa.Table) -> pa.Table:
        if not batch.num_rows:  # an empty file's block: fixed_width refuses a column of no rows
            return output_schema(batch.schema, self.task).empty_table()
        with torch.no_grad():
            out = self.model(self._features(batch)).float().cpu()
        fields = prediction_fields(self.task)
        if self.task == "classification":
            probabilities = torch.softmax(out, dim=1).numpy()
            batch = batch.append_column(fields[0], pa.array(out.argmax(dim=1).numpy()))
            return batch.append_column(fields[1], _lists(probabilities))
        return batch.append_column(fields[0], _lists(out.numpy()))

    def _features(self, batch: pa.Table) -> torch.Tensor:
        matrix = fixed_width(batch.column(self.feature_column), self.feature_column)
        # float32 lists arrive as a read-only view of Arrow's buffer: a model that writes its input in
        # place (ReLU(inplace=True)) would write the batch, and torch warns of it, so that view alone is copied
        features = torch.from_numpy(matrix) if matrix.flags.writeable else torch.tensor(matrix)
        return features.to(self.device)


def _lists(matrix: np.ndarray) -> pa.Array:
    """An (n, k) float32 matrix as a list<float> column."""
    return pa.FixedSizeListArray.from_arrays(pa.array(matrix.reshape(-1)), matrix.shape[1]).cast(pa.list_(pa.float32()))


def split_cpus(num_workers: int, cluster_cpus: float) -> tuple[float, float]:
    """CPUs for each read task and for each actor: the pool together leaves a read's CPUs free.

    A pool that holds every CPU starves Ray Data's read tasks, and predict waited forever with
    no rows to predict (1 CPU per actor, --num-workers 4 on 4 CPUs). So each actor takes at most
    1 CPU and the pool at most the cluster's CPUs less one read's (1 CPU; half the cluster on one
    of under 2 CPUs): an actor's work is a forward pass on one thread, a fraction of a CPU each
    costs little, while reads that never run cost everything."""
    reads = min(READ_CPUS, cluster_cpus / 2)
    share = min(1.0, (round((cluster_cpus - reads) * CPU_STEPS) // num_workers) / CPU_STEPS)
    if share <= 0:
        raise ValueError(f"--num-workers {num_workers}: more actors than the cluster's {cluster_cpus:g} CPUs can share")
    return reads, share


def predict(
    trained: TrainedModel,
    filesystem: pafs.FileSystem,
    files: list[str],
    out: storage.Location,
    *,
    feature_column: str,
    batch_size: int,
    num_workers: int,
    use_gpu: bool,
    stall_timeout_s: float,
) -> int:
    """Run the actor pool over ``files`` and write ``out``; returns the rows written. Ray must be connected."""
    import ray
    import ray.data
    from ray.data.exceptions import ExecutionTimeoutError

    # A context of predict's own: a dataset keeps the one current when it is made, and the
    # process's (a test session's, a notebook's) stays as it was.
    context = copy.deepcopy(ray.data.DataContext.get_current())
    context.execution_options.preserve_order = True  # output rows in input order
    context.enable_progress_bars = False  # raypar prints its own one line
    # Ray Data's own guard: no block moving for this long ends the run instead of a silent wait.
    context.execution_no_progress_timeout_s = stall_timeout_s
    read_cpus, cpus = split_cpus(num_workers, ray.cluster_resources().get("CPU", 0.0))
    footer_pool = {FOOTER_READERS_ENV: str(footer_reader_count(len(files)))}
    with ray.data.DataContext.current(context), env_defaults(footer_pool):
        dataset = ray.data.read_parquet(files, filesystem=filesystem, num_cpus=read_cpus).map_batches(
            Predictor,
            fn_constructor_kwargs={"trained": trained, "feature_column": feature_column, "use_gpu": use_gpu},
            batch_format="pyarrow",
            batch_size=batch_size,
            compute=ray.data.ActorPoolStrategy(size=num_workers),
            num_cpus=cpus,
            num_gpus=1 if use_gpu else 0,
        )
    schema = output_schema(pq.read_schema(files[0], filesystem=filesystem), trained.task)
    try:
        return write_parquet(out, dataset.iter_batches(batch_format="pyarrow", batch_size=None), schema)
    except ExecutionTimeoutError:
        actors = f"{num_workers} actor{'s' if num_workers > 1 else ''}"
        raise PredictFailed(
            f"no predictions for {stall_timeout_s:g} s (--stall-timeout-s): waited for {actors} "
            f"({cpus:g} CPU{', 1 GPU' if use_gpu else ''} each) and Ray Data's reads of --data; "
            "`ray status` shows what the cluster lacks"
        ) from None


def footer_reader_count(num_files: int) -> int:
    """Footer readers for ``num_files`` files: one per batch of files, at most Ray Data's 32."""
    files_per_batch = max(1, int(os.environ.get(FOOTER_BATCH_ENV, "10")))
    return min(MAX_FOOTER_READERS, -(-num_files // files_per_batch))


def write_parquet(out: storage.Location, batches, schema: pa.Schema) -> int:
    """Write ``batches`` to ``out`` whole or not at all; returns the rows written.

    No batch (an input of 0 rows) still writes a valid Parquet file of ``schema`` and no rows:
    the output has the input's rows, all 0 of them, and a pipeline reading it gets the columns it
    expects rather than a refusal to handle on empty days."""
    rows = 0

    def write(stream) -> None:
        nonlocal rows
        with pq.ParquetWriter(stream, schema) as writer:
            for batch in batches:
                if batch.num_rows:
                    writer.write_table(batch.cast(schema))
                    rows += batch.num_rows

    storage.write(out, write)  # its temporary file goes when the writer fails (Ctrl-C, a Ray error)
    return rows
