"""``python -m ray_jobs.predict``: bad input is one ``error:`` line, before Ray."""

from __future__ import annotations

from ray_jobs.predict import job as predict
from tests.helpers import fake_run


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
