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


# The language-model example, smaller: the json package (one of its 5 files held out), one epoch, a
# 1-layer 32-wide model.
SMALLER = {
    "--epochs": "1",
    "--max-new-tokens": "20",
    "--vocab-size": "300",
    "--batch-size": "16",
    "--val-fraction": "0.25",
    "--warmup-steps": "2",
}
SMALLER_OPTIONS = {"n_layer=4": "n_layer=1", "n_embd=128": "n_embd=32"}


def lm_commands(stdlib: str) -> list[tuple[str, list[str]]]:
    text = (REPO / "examples" / "language_model.md").read_text().replace("$STDLIB", stdlib)
    found = []
    for module, args in re.findall(r"^python -m (\S+) (.*)$", text, re.M):
        argv = [SMALLER_OPTIONS.get(arg, arg) for arg in shlex.split(args)]
        for flag, value in SMALLER.items():
            if flag in argv:
                argv[argv.index(flag) + 1] = value
        if "--input" in argv:  # the json package alone
            start = argv.index("--input") + 1
            end = next(i for i in range(start, len(argv)) if argv[i].startswith("--"))
            argv[start:end] = [f"{stdlib}/json/*.py"]
        found.append((module, argv))
    return found


def test_the_language_model_example_runs_smaller(ray_cluster, tmp_path, monkeypatch, capsys):
    import sysconfig

    from ray_jobs import generate

    monkeypatch.chdir(tmp_path)
    mains = {**MAINS, "ray_jobs.generate": generate.main}
    commands = lm_commands(sysconfig.get_paths()["stdlib"])
    assert [module for module, _ in commands] == ["ray_jobs.data", "ray_jobs.ddp", "ray_jobs.generate"]
    for module, argv in commands:
        capsys.readouterr()  # what the command before printed
        assert mains[module](argv) == 0, (module, argv)
    run = tmp_path / "runs" / "gpt-stdlib"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "lm" and summary["block_size"] == 128 and len(summary["val_perplexity"]) == 1
    assert summary["tokens_per_second"] > 0 and (run / "tokenizer.json").exists()
    assert capsys.readouterr().out.startswith("def ")  # the prompt, then what the model wrote
