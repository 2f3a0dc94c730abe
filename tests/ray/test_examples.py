"""``examples/``: its README's commands, run as written, in a copy of the folder."""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pyarrow.parquet as pq
import pytest
import torch

from models import build_model
from ray_jobs import ddp
from ray_jobs.data import __main__ as data
from ray_jobs.data.parquet import read_dataset
from ray_jobs.predict import job as predict
from tests.helpers import REPO

pytestmark = pytest.mark.ray
# The entry points the commands name, called in this process: they join the session's cluster
# instead of starting a Ray each (a command's `connect` finds Ray initialised).
MAINS = {"ray_jobs.data": data.main, "ray_jobs.ddp": ddp.main, "ray_jobs.predict": predict.main}


def commands() -> list[tuple[str, list[str]]]:
    readme = (REPO / "examples" / "README.md").read_text()
    return [(module, shlex.split(args)) for module, args in re.findall(r"^python -m (\S+) (.*)$", readme, re.M)]


def test_the_examples_commands_run_as_written(ray_cluster, tmp_path, monkeypatch):
    work = tmp_path / "examples"
    shutil.copytree(REPO / "examples", work)
    monkeypatch.chdir(work)  # as the README says: run from the folder, so my_model imports
    monkeypatch.syspath_prepend(str(work))
    ran = [module for module, _ in commands()]
    assert ran == ["ray_jobs.data"] * 3 + ["ray_jobs.ddp", "ray_jobs.predict"]
    for module, argv in commands():
        assert MAINS[module](argv) == 0, (module, argv)

    summary = json.loads((work / "runs" / "example" / "summary.json").read_text())
    assert summary["model"] == {
        "name": "my_model:tower",
        "in_features": 6,
        "out_features": 3,
        "hidden": 16,
        "act": "gelu",
    }
    assert len(summary["val_losses"]) == len(summary["val_accuracy"]) == 3
    assert summary["best_epoch"] == 1 + min(range(3), key=summary["val_losses"].__getitem__)
    assert list((work / "runs" / "example" / "tensorboard").glob("events.out.tfevents.*"))
    model = build_model(**summary["model"])
    model.load_state_dict(torch.load(work / "runs" / "example" / "best_model.pt", weights_only=True))
    with torch.no_grad():
        expected = model(torch.from_numpy(read_dataset(str(work / "data" / "new.parquet")).features.copy()))
    predictions = pq.read_table(work / "data" / "predictions.parquet")
    assert predictions.column("prediction").to_pylist() == expected.argmax(dim=1).tolist()
