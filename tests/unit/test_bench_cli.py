"""``python -m ray_jobs.bench``'s command line (no Ray): a bad flag, and ``--render``."""

from __future__ import annotations

import json
import shutil

import pytest

from ray_jobs.bench.report import render
from ray_jobs.bench.run import main
from tests.helpers import REPO


def test_bad_suite_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--suite", "nope"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m ray_jobs.bench: error: --suite 'nope' is unknown; valid: quick, full, gpu, smoke (see --help)"
    ]


def test_render_writes_the_report_anew_from_a_finished_runs_json(tmp_path, capsys):
    shutil.copy(REPO / "docs" / "bench" / "bench.json", tmp_path / "bench.json")
    assert main(["--render", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.md").read_text() == render(results)
    plots = results["plots"]  # PNGs with the bench extra installed, else why not
    assert all((tmp_path / name).is_file() for name in plots) if isinstance(plots, list) else "matplotlib" in plots
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'bench.md'}")


@pytest.mark.parametrize("content", [None, "{not json", '{"suite": "quick", "complete": false}'])
def test_render_of_a_missing_unreadable_or_unfinished_json_is_one_error_line(tmp_path, capsys, content):
    if content is not None:
        (tmp_path / "bench.json").write_text(content)
    assert main(["--render", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --render {tmp_path}: ")
    assert not (tmp_path / "bench.md").exists()
