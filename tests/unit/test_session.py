"""An address that does not answer is one ``error:`` line and exit 2, in seconds, for every entry
point; stale records and addresses of the wrong kind are named."""

from __future__ import annotations

import pytest

from ray_jobs import ddp, dp
from ray_jobs.bench import run as bench
from ray_jobs.driver import connect as session
from ray_jobs.pipeline import trainer as pipeline
from ray_jobs.predict import job as predict
from tests.helpers import closed_port

ENTRY_POINTS = {
    "ddp": ddp.main,
    "dp": dp.main,
    "pipeline": pipeline.main,
    "bench": bench.main,
    # predict has no --storage-path: it writes only --out
    "predict": lambda argv: predict.main([*argv[:2], "--run-dir", "runs/x", "--data", "x", "--out", "x"]),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_an_address_that_does_not_answer_is_one_line(entry, tmp_path, capsys):
    port = closed_port()
    code = ENTRY_POINTS[entry](["--address", f"127.0.0.1:{port}", "--storage-path", str(tmp_path / "runs")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --address 127.0.0.1:{port}: no Ray cluster answers there"), err
    assert "drop --address to start a local Ray" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # checked before anything is written


def test_ray_address_from_the_environment_is_named_as_such(monkeypatch, capsys):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{closed_port()}")
    assert ddp.main([]) == 2
    assert capsys.readouterr().err.startswith("error: RAY_ADDRESS 127.0.0.1:")


def test_auto_names_the_stale_record_and_how_to_fix_it(ray_tmpdir):
    port = closed_port()
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}\n")
    with pytest.raises(
        ValueError,
        match=rf"--address auto \(127\.0\.0\.1:{port}\): no Ray cluster answers there "
        r".*the recorded head is gone: start it again with `ray start --head`",
    ):
        session.reachable("auto")


def test_auto_without_a_running_cluster(ray_tmpdir):
    with pytest.raises(ValueError, match="--address auto: no Ray cluster is running on this machine"):
        session.reachable("auto")


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("http://127.0.0.1:8265", "is a dashboard \\(job API\\) address"),
        ("headnode", "expected host:port"),
    ],
)
def test_addresses_of_the_wrong_kind(address, message):
    with pytest.raises(ValueError, match=message):
        session.reachable(address)
