"""Helpers shared by the distributed tests."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from cluster.local import free_port
from models import build_model
from ray_jobs import ddp, dp
from ray_jobs.core.config import TrainConfig, WorkerScaling
from ray_jobs.data import storage
from ray_jobs.data.order import stream_epoch_order
from ray_jobs.data.parquet import TOKENS_COLUMN, VOCAB_SIZE_KEY, read_dataset, synthesize, write_table
from ray_jobs.data_parallel import fsdp
from ray_jobs.driver.prepare import prepare
from ray_jobs.driver.summary import TrainSummary
from ray_jobs.pipeline import trainer as pipeline
from ray_jobs.predict import job as predict
from ray_jobs.testing.faults import Faults
from tests.reference import reference_train

REPO = Path(__file__).resolve().parents[1]


def fresh_output(code: str, stdin: bytes | None = None) -> str:
    """What a fresh interpreter prints running ``code`` from the repository (a process that starts
    as a Ray worker or a command does, with nothing of this test process loaded)."""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, input=stdin, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()[-2000:]  # the child's traceback, not just its status
    return result.stdout.decode()


def modules_after(statements: str, stdin: bytes | None = None) -> list[str]:
    """The modules a fresh interpreter holds after running ``statements`` from the repository: what
    a Ray worker or a spawned process that does the same loads (the tests that keep torch, FSDP or
    Ray out of one)."""
    return fresh_output(f"import sys\n{statements}\nprint(*sys.modules)", stdin).splitlines()[-1].split()


def tensors(path: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Features, targets and output width of a dataset, for the reference."""
    dataset = read_dataset(path)
    return torch.from_numpy(dataset.features.copy()), torch.from_numpy(dataset.targets.copy()), dataset.out_features


def run_strategy(strategy: str, cfg: TrainConfig, num_workers: int = 1, scaling=None, **faults) -> TrainSummary:
    """Run a strategy through the same Python API its entry point uses; ``faults``: ``Faults``'s
    fields, what the test injects."""
    prepared = prepare(cfg, strategy)
    injected = Faults(**faults)
    if strategy == "ddp":
        return ddp.run(prepared, scaling or WorkerScaling(num_workers=num_workers), injected)
    if strategy == "fsdp":
        return fsdp.run(prepared, scaling or fsdp.ShardedScaling(num_workers=num_workers), injected)
    if strategy == "pipeline":
        return pipeline.run(prepared, scaling, injected)
    return dp.run(prepared, scaling or dp.DataParallelScaling(), injected)


def reference_for(cfg: TrainConfig, init_state: dict | None = None, norms: list[float] | None = None, factory=None):
    """The single-process reference for a config, from the same data file; a streamed run's
    (``--ingest stream``) visits rows in order contract v2's order."""
    features, targets, out_features = tensors(cfg.data)
    options = {k: v for k, v in cfg.model_options.items() if v is not None}
    if cfg.model == "gpt" and targets.dim() == 2:  # raypar's gpt takes the data's context length by default
        options.setdefault("block_size", targets.shape[1])
    keys = (
        "model",
        "epochs",
        "batch_size",
        "lr",
        "seed",
        "shuffle",
        "optimizer",
        "momentum",
        "weight_decay",
        "precision",
        "lr_schedule",
        "warmup_steps",
        "min_lr",
        "grad_clip_norm",
    )
    orders = None
    if cfg.ingest == "stream":
        rows = block_rows(cfg.data)

        def orders(epoch: int) -> torch.Tensor:
            return stream_epoch_order(rows, cfg.seed, epoch, cfg.shuffle, cfg.shuffle_window_rows)

    return reference_train(
        features=features,
        targets=targets,
        out_features=out_features,
        init_state=init_state,
        epoch_orders=orders,
        norms=norms,
        **{k: getattr(cfg, k) for k in keys},
        **options,
        **({"factory": factory} if factory is not None else {}),
    )


def write_tokens(path: str, rows: int, block_size: int, vocab_size: int = 257, row_group_rows: int = 16384) -> str:
    """A language model's data as tokenize writes it: byte tokens of real text (a standard library
    source), ``rows`` rows of ``block_size + 1`` consecutive tokens, ``raypar.vocab_size`` stated."""
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_bytes()
    stream = np.frombuffer(text, dtype=np.uint8).astype(np.int32) % vocab_size
    tokens = [stream[i * block_size : i * block_size + block_size + 1] for i in range(rows)]
    table = pa.table(
        {TOKENS_COLUMN: pa.array(tokens, type=pa.list_(pa.int32()))},
        metadata={VOCAB_SIZE_KEY: str(vocab_size).encode()},
    )
    write_table(table, path, row_group_rows)
    return path


GPT = ["n_layer=2", "n_head=2", "n_embd=16"]


def run_config(data: str, tmp_path, **settings) -> TrainConfig:
    """A test run's config: ``data`` trained into ``<tmp_path>/run``, everything else as given."""
    return TrainConfig(**{"data": data, "storage_path": str(tmp_path), "name": "run", **settings})


def scheduled_config(data: str, tmp_path, **settings) -> TrainConfig:
    """``run_config`` with a cosine schedule, its warmup and a global-norm clip on, the settings
    that share the step count across workers and stages; ``settings`` add to or override them."""
    return run_config(data, tmp_path, **{"lr_schedule": "cosine", "warmup_steps": 2, "grad_clip_norm": 1.0, **settings})


def lm_config(data: str, tmp_path, **changes) -> TrainConfig:
    """A few steps of the tiny gpt with a schedule, warmup and a clip; SGD (see tests/ray/test_lm.py)."""
    settings = {"model": "gpt", "model_option": GPT, "epochs": 1, "batch_size": 8, "lr": 0.5, "seed": 4}
    return scheduled_config(data, tmp_path, **{**settings, **changes})


# A streamed dataset's files: uneven row groups, 40 rows in groups of 7, 56 in 16, 24 in 5.
STREAM_FILES = [(40, 7), (56, 16), (24, 5)]


def write_parts(directory, task: str = "regression", query: str = "") -> str:
    """``STREAM_FILES`` under ``directory`` (a path or a URI, its options in ``query``)."""
    table = synthesize(sum(rows for rows, _ in STREAM_FILES), 6, 4 if task == "classification" else 3, task, seed=3)
    start = 0
    for index, (rows, group) in enumerate(STREAM_FILES):
        write_table(table.slice(start, rows), f"{directory}/part-{index}.parquet{query}", row_group_rows=group)
        start += rows
    return f"{directory}{query}"


def block_rows(path: str) -> list[int]:
    """Row counts of a Parquet file's or directory's row groups, files in name order."""
    files = sorted(Path(path).glob("*.parquet")) if Path(path).is_dir() else [Path(path)]
    return [
        meta.row_group(i).num_rows for meta in (pq.read_metadata(f) for f in files) for i in range(meta.num_row_groups)
    ]


def load_weights(run_dir: str) -> dict[str, torch.Tensor]:
    return torch.load(f"{run_dir}/model.pt", weights_only=True)


def assert_same_weights(got: dict, expected: dict, exact: bool = False) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        if exact:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
        else:
            # gloo all-reduce averages the workers' shard gradients, a different summation order
            # than one full-batch mean: float32 rounding (~1e-7 per step) over a few dozen steps.
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def assert_trains_the_reference(summary: TrainSummary, cfg: TrainConfig, init_state: dict | None = None) -> None:
    """The run's ``model.pt`` and per-epoch losses are the single-process reference's for ``cfg``,
    from ``init_state`` when given (weights: ``assert_same_weights``' tolerance; losses: the same
    float32 sums over the workers' slices, in another order)."""
    expected_weights, expected_losses = reference_for(cfg, init_state)
    assert_same_weights(load_weights(summary.run_dir), expected_weights)
    assert summary.losses == pytest.approx(expected_losses, rel=1e-5)


def with_(cfg: TrainConfig, **changes) -> TrainConfig:
    return dataclasses.replace(cfg, **changes)


def cluster_cli(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m cluster.local ...`` with nothing of the shared test cluster in its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return subprocess.run(
        [sys.executable, "-m", "cluster.local", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def running_cluster(state_dir: str, *argv: str):
    """``cluster.local up`` with ``argv`` (checked to start), always stopped afterwards, even when
    the test fails; yields ``up``'s result and its ports."""
    try:
        started, ports = cluster_up(state_dir, *argv)
        assert started.returncode == 0, started.stdout + started.stderr
        yield started, ports
    finally:
        stopped = cluster_cli("down", "--state-dir", state_dir, "--timeout", "15")
        assert stopped.returncode == 0, stopped.stderr


def cluster_up(state_dir: str, *argv: str, attempts: int = 3) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``up`` on ports picked free just now, and picked again if one was taken in between.

    Ports picked at import time were in use by the time the cluster started, minutes later
    (seen in CI; the shared cluster's workers listen on ephemeral ports too)."""
    for _ in range(attempts):
        ports = ["--port", str(free_port()), "--dashboard-port", str(free_port())]
        started = cluster_cli("up", "--state-dir", state_dir, *argv, *ports)
        if "already in use" not in started.stderr:
            break
    return started, ports


def plain_validation(model_record: dict, weights: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The validation loss and accuracy as plain PyTorch computes them: one forward of the whole set."""
    model = build_model(**model_record)
    model.load_state_dict(weights)
    model.eval()
    with torch.no_grad():
        out = model(x)
    if y.dtype == torch.int64:
        return nn.CrossEntropyLoss()(out, y).item(), (out.argmax(dim=1) == y).double().mean().item()
    return nn.MSELoss()(out, y).item(), None


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
    storage.write_bytes(
        storage.join(run_dir, "summary.json"), json.dumps({"model": record, "task": task, "config": {}}).encode()
    )
    return models["model.pt"]


def expected_predictions(model: torch.nn.Module, data_dir: str) -> torch.Tensor:
    """``model(x)`` from a plain ``torch.load``, the rows in input order (files in name order)."""
    features = torch.from_numpy(read_dataset(data_dir).features.copy())
    with torch.no_grad():
        return model(features)


def predicts_the_model_in_input_order(base: str, query: str, task: str, num_workers: int) -> None:
    """``python -m ray_jobs.predict`` over a fake run's model under ``base`` (a path or a URI, its
    options in ``query``): every input column kept, predictions equal to ``model(x)`` in input order."""
    data_dir = write_parts(f"{base}/new", task, query)  # 3 files, uneven row groups: 120 rows
    run_dir, out = f"{base}/runs/run{query}", f"{base}/pred.parquet{query}"
    model = fake_run(run_dir, task)
    argv = [
        "--run-dir",
        run_dir,
        "--data",
        data_dir,
        "--out",
        out,
        "--batch-size",
        "16",
        "--num-workers",
        str(num_workers),
    ]
    assert predict.main(argv) == 0
    filesystem, path = storage.resolve(out)
    table = pq.read_table(path, filesystem=filesystem)
    data = read_dataset(data_dir)
    expected = expected_predictions(model, data_dir)
    assert table.column_names[:2] == ["features", "target"]  # every input column kept
    torch.testing.assert_close(torch.tensor(table.column("features").to_pylist()), torch.tensor(data.features))
    if task == "classification":
        assert table.column("prediction").to_pylist() == expected.argmax(dim=1).tolist()
        probabilities = torch.tensor(table.column("probabilities").to_pylist())
        # the same float32 model on the same rows; only the batch cut differs (matmul rounding)
        torch.testing.assert_close(probabilities, torch.softmax(expected, dim=1), rtol=1e-5, atol=1e-6)
        assert table.column("target").to_pylist() == data.targets.tolist()
    else:
        torch.testing.assert_close(torch.tensor(table.column("prediction").to_pylist()), expected, rtol=1e-5, atol=1e-6)


def closed_port() -> int:
    with socket.socket() as probe:  # bound, never listening: connections are refused
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
