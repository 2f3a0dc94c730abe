"""``python -m ray_jobs.predict``: bad input is one ``error:`` line, before Ray; an actor reads Arrow rows as given."""

from __future__ import annotations

import io
import json
import os
import warnings

import pyarrow as pa
import pytest
import torch

from models import build_model
from ray_jobs.data import storage
from ray_jobs.driver.connect import env_defaults
from ray_jobs.predict import job as predict
from ray_jobs.predict.inference import (
    FOOTER_BATCH_ENV,
    FOOTER_READERS_ENV,
    Predictor,
    check_output,
    footer_reader_count,
    split_cpus,
    write_parquet,
)
from ray_jobs.predict.trained import TrainedModel, load_run
from tests.helpers import fake_run, write_parts


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
    cases.append(
        (
            ["--run-dir", str(tmp_path / "run"), "--checkpoint", "best"],
            f"error: --run-dir {tmp_path / 'run'} has no best_model.pt (the run had no --val-data)",
        )
    )
    for argv, message in cases:
        full = {"--run-dir": str(tmp_path / "run"), "--data": regression_data, "--out": str(tmp_path / "o.parquet")}
        full.update(dict(zip(argv[::2], argv[1::2])))
        if argv == ["--data", regression_data]:
            full.pop("--run-dir")
        assert predict.main([item for pair in full.items() for item in pair]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (argv, err)
    # the width check: a 4-class model's run reads 6 features; a file of 5 per row is refused
    from ray_jobs.data.parquet import synthesize, write_table

    write_table(synthesize(8, 5, 3, "regression", seed=0), str(tmp_path / "five.parquet"))
    assert (
        predict.main(
            [
                "--run-dir",
                str(tmp_path / "run"),
                "--data",
                str(tmp_path / "five.parquet"),
                "--out",
                str(tmp_path / "o.parquet"),
            ]
        )
        == 2
    )
    assert "has 5 features per row; the model takes 6" in capsys.readouterr().err
    assert not (tmp_path / "o.parquet").exists()


def _argv(run_dir, data, out, *extra: str) -> list[str]:
    return ["--run-dir", str(run_dir), "--data", str(data), "--out", str(out), *extra]


def _rewrite_model(run_dir, **record) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["model"] = record
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_a_run_directory_is_data_a_hostile_summary_runs_nothing(tmp_path, capsys, regression_data):
    """summary.json names a callable and its arguments; predict must not call what it names."""
    fake_run(str(tmp_path / "run"), "regression")
    ran = tmp_path / "ran"
    _rewrite_model(tmp_path / "run", name="subprocess:call", in_features=["sh", "-c", f"id > {ran}"], out_features=3)
    for extra in ([], ["--trust-model-code"], ["--model", "subprocess:call"]):
        assert predict.main(_argv(tmp_path / "run", regression_data, tmp_path / "o.parquet", *extra)) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --run-dir "), (extra, err)
        assert "summary.json" in err[0] and "in_features" in err[0], err
        assert not ran.exists()
    # well-typed, but a callable no raypar run records: refused unless the user names it
    _rewrite_model(tmp_path / "run", name="subprocess:call", in_features=6, out_features=3, shell="id")
    assert predict.main(_argv(tmp_path / "run", regression_data, tmp_path / "o.parquet")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model subprocess:call" in err[0] and "--trust-model-code" in err[0], err
    assert not ran.exists()
    bad_fields = [
        ({"name": 7, "in_features": 6, "out_features": 3}, "name"),
        ({"name": "seed-mlp", "in_features": True, "out_features": 3}, "in_features"),
        ({"name": "seed-mlp", "in_features": 6, "out_features": 0}, "out_features"),
        ({"name": "seed-mlp", "in_features": 6, "out_features": 3, "hidden": [8]}, "hidden"),
        ({"name": "seed-mlp", "in_features": 6, "out_features": 3, "hidden": {"a": 1}}, "hidden"),
    ]
    for record, field_name in bad_fields:
        _rewrite_model(tmp_path / "run", **record)
        assert predict.main(_argv(tmp_path / "run", regression_data, tmp_path / "o.parquet")) == 2, record
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "summary.json" in err[0] and field_name in err[0], (record, err)


def test_a_user_model_is_built_when_the_user_names_it_or_trusts_the_run(tmp_path, user_module, regression_data):
    """``--model`` naming the run's callable, or ``--trust-model-code``, lets ``load_run`` build it."""
    name = f"{user_module}:build"
    fake_run(str(tmp_path / "run"), "regression")
    record = {"name": name, "in_features": 6, "out_features": 3, "hidden": 5, "act": "tanh"}
    _rewrite_model(tmp_path / "run", **record)
    weights = build_model(**record).state_dict()
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    (tmp_path / "run" / "model.pt").write_bytes(buffer.getvalue())
    for model, trust in ((name, False), (None, True)):
        trained = load_run(str(tmp_path / "run"), "final", model=model, trust_model_code=trust)
        assert trained.record == record
        got = trained.load(torch.device("cpu")).state_dict()
        assert all(torch.equal(got[key], weights[key]) for key in weights)
    with pytest.raises(ValueError, match=r"add --model .*:build \(or --trust-model-code"):
        load_run(str(tmp_path / "run"), "final", model=None, trust_model_code=False)
    with pytest.raises(ValueError, match=r"--model seed-mlp does not match the run's model"):
        load_run(str(tmp_path / "run"), "final", model="seed-mlp", trust_model_code=False)


def test_the_actor_pool_always_leaves_a_cpu_for_reads():
    """split_cpus: each actor at most 1 CPU, the pool at most the cluster less one read's CPUs."""
    assert split_cpus(1, 4.0) == (1.0, 1.0)
    assert split_cpus(3, 4.0) == (1.0, 1.0)
    assert split_cpus(4, 4.0) == (1.0, 0.75)
    assert split_cpus(5, 4.0) == (1.0, 0.6)
    assert split_cpus(3, 1.0) == (0.5, 0.1666)  # under 2 CPUs: half for reads; shares round down
    for num_workers, cluster_cpus in ((4, 4.0), (5, 4.0), (7, 3.0), (3, 1.0), (64, 16.0)):
        reads, each = split_cpus(num_workers, cluster_cpus)
        assert each <= 1 and num_workers * each + reads <= cluster_cpus, (num_workers, cluster_cpus)
    with pytest.raises(ValueError, match="--num-workers 100000: more actors than the cluster's 4 CPUs can share"):
        split_cpus(100_000, 4.0)


def test_out_is_checked_before_any_work_and_never_over_the_data(tmp_path, capsys, regression_data, monkeypatch):
    """A directory as --out, --out equal to --data or inside --data's directory: one line, before
    the run is read (load_run is not reached), nothing written."""
    fake_run(str(tmp_path / "run"), "regression")
    data_dir = tmp_path / "new"
    write_parts(str(data_dir))
    (tmp_path / "outdir").mkdir()
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(predict, "load_run", lambda *a, **k: pytest.fail("--out is checked before the run is read"))
    cases = [
        (data_dir, tmp_path / "outdir", "is a directory: name the Parquet file to write"),
        (data_dir, tmp_path / "a_file" / "pred.parquet", "a_file is a file, not a directory to write into"),
        (data_dir, data_dir, "is --data itself"),
        (regression_data, regression_data, "is --data itself"),
        (data_dir, data_dir / "pred.parquet", "is inside --data's directory"),
        (data_dir, data_dir / "deeper" / "pred.parquet", "is inside --data's directory"),
    ]
    for data, out, message in cases:
        before = sorted(p.name for p in tmp_path.rglob("*"))
        assert predict.main(_argv(tmp_path / "run", data, out)) == 2, (data, out)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --out {out}") and message in err[0], err
        assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, not even .partial
    # beside a single --data file is fine: that file alone is the data
    assert check_output(str(tmp_path / "pred.parquet"), regression_data).path == str(tmp_path / "pred.parquet")


def test_a_failed_write_leaves_no_partial_file(tmp_path):
    """Predictions that fail mid-stream (a Ray error, Ctrl-C) leave neither <out> nor <out>.partial."""
    schema = pa.schema([pa.field("features", pa.list_(pa.float32()))])
    out = check_output(str(tmp_path / "pred.parquet"), str(tmp_path / "data.parquet"))

    def batches():
        yield pa.table({"features": [[1.0, 2.0]]}, schema=schema)
        raise OSError("the object store went away")

    with pytest.raises(OSError, match="went away"):
        write_parquet(out, batches(), schema)
    assert list(tmp_path.iterdir()) == []


def test_a_language_models_run_is_sent_to_generate():
    from ray_jobs.predict.trained import run_task

    with pytest.raises(ValueError, match=r"language model's run: .* python -m ray_jobs.generate runs/lm --prompt TEXT"):
        run_task({"task": "lm"}, "runs/lm")


def writes_its_input(in_features: int, out_features: int) -> torch.nn.Module:
    """A user's model whose first layer writes its input in place."""
    return torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(in_features, out_features))


@pytest.fixture
def warn_always():
    """torch warns of a read-only NumPy array once per process: an earlier test may have used it up."""
    before, threads = torch.is_warn_always_enabled(), torch.get_num_threads()
    torch.set_warn_always(True)
    yield
    torch.set_warn_always(before)
    torch.set_num_threads(threads)  # Predictor sets its actor's process to one thread


@pytest.mark.parametrize("value_type", [pa.float32(), pa.float64()])
def test_the_predictor_reads_arrow_rows_without_a_warning_and_never_writes_them(tmp_path, warn_always, value_type):
    torch.manual_seed(0)
    model = writes_its_input(2, 3)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    (tmp_path / "model.pt").write_bytes(buffer.getvalue())
    record = {"name": "tests.unit.test_predict:writes_its_input", "in_features": 2, "out_features": 3}
    trained = TrainedModel(record, "regression", storage.locate(str(tmp_path / "model.pt")), writes_its_input)
    rows = [[-1.0, 2.0], [3.0, -4.0]]
    batch = pa.table({"x": pa.array(rows, type=pa.list_(value_type))})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = Predictor(trained, "x", use_gpu=False)(batch)
    assert got.column("x").to_pylist() == rows  # the model's ReLU wrote a copy, not Arrow's buffer
    with torch.no_grad():
        expected = model(torch.tensor(rows))
    assert got.column("prediction").to_pylist() == expected.tolist()


def test_a_read_gets_a_footer_reader_per_batch_of_files_and_a_users_setting_stands(monkeypatch):
    """Ray Data's footer pool: one reader per batch of files (10, or the batch size set), at most its 32."""
    monkeypatch.delenv(FOOTER_READERS_ENV, raising=False)
    monkeypatch.delenv(FOOTER_BATCH_ENV, raising=False)
    assert [footer_reader_count(n) for n in (1, 10, 11, 320, 5000)] == [1, 1, 2, 32, 32]
    with env_defaults({FOOTER_READERS_ENV: str(footer_reader_count(25))}):  # as predict sets it
        assert os.environ[FOOTER_READERS_ENV] == "3"
    assert FOOTER_READERS_ENV not in os.environ  # only while the read is planned
    monkeypatch.setenv(FOOTER_BATCH_ENV, "4")
    assert footer_reader_count(25) == 7
    monkeypatch.setenv(FOOTER_READERS_ENV, "8")
    with env_defaults({FOOTER_READERS_ENV: str(footer_reader_count(25))}):
        assert os.environ[FOOTER_READERS_ENV] == "8"
    assert os.environ[FOOTER_READERS_ENV] == "8"
