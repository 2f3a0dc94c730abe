"""Re-running a name: the first attempt's settings hold, what may change is named, no Ray needed
(the checks run before Ray is touched)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from ray_jobs import ddp, dp
from ray_jobs.core.checkpoint import TrainState, checkpoint_name, write_checkpoint
from ray_jobs.core.config import TrainConfig
from ray_jobs.driver.prepare import prepare
from ray_jobs.driver.rerun import FIXED, GROWABLE, OPERATIONAL, RUN_FILE, AlreadyComplete, check_rerun
from ray_jobs.pipeline import trainer as pipeline

ENTRY_POINTS = {"ddp": ddp.main, "dp": dp.main, "pipeline": pipeline.main}
# Each setting that decides the weights, changed: (flags, what the error names).
CHANGES = {
    "data": (["--data", "OTHER"], "--data {data} -> {other}"),
    "feature_column": (["--feature-column", "x"], "--feature-column features -> x"),
    "target_column": (["--target-column", "y"], "--target-column target -> y"),
    "task": (["--task", "regression"], "--task auto -> regression"),
    "num_classes": (["--num-classes", "3"], "--num-classes (unset) -> 3"),
    "vocab_size": (["--vocab-size", "300"], "--vocab-size (unset) -> 300"),
    "model": (["--model", "mlp"], "--model seed-mlp -> mlp"),
    "val_data": (["--val-data", "OTHER"], "--val-data (unset) -> {other}"),
    "model_option": (["--model", "mlp", "--model-option", "depth=3"], "--model-option [] -> ['depth=3']"),
    "hidden": (["--hidden", "9"], "--hidden 8 -> 9"),
    "depth": (["--model", "mlp", "--depth", "3"], "--depth (unset) -> 3"),  # seed-mlp has no depth
    "dropout": (["--model", "mlp", "--dropout", "0.1"], "--dropout (unset) -> 0.1"),
    "init_from": (["--init-from", "INIT"], "--init-from (unset) -> {init}"),
    "batch_size": (["--batch-size", "8"], "--batch-size 16 -> 8"),
    "lr": (["--lr", "0.5"], "--lr 0.05 -> 0.5"),
    "lr_schedule": (["--lr-schedule", "cosine"], "--lr-schedule constant -> cosine"),
    "warmup_steps": (["--warmup-steps", "2"], "--warmup-steps 0 -> 2"),
    "min_lr": (["--min-lr", "0.01"], "--min-lr 0.0 -> 0.01"),
    "grad_clip_norm": (["--grad-clip-norm", "1.0"], "--grad-clip-norm (unset) -> 1.0"),
    "grad_accum_steps": (["--grad-accum-steps", "2"], "--grad-accum-steps 1 -> 2"),
    "optimizer": (["--optimizer", "adamw", "--momentum", "0"], "--optimizer sgd -> adamw"),
    "momentum": (["--momentum", "0.5"], "--momentum 0.9 -> 0.5"),
    "weight_decay": (["--weight-decay", "0.1"], "--weight-decay 0.0 -> 0.1"),
    "seed": (["--seed", "3"], "--seed 11 -> 3"),
    "shuffle": (["--no-shuffle"], "--shuffle on -> off"),
    "precision": (["--precision", "bf16"], "--precision fp32 -> bf16"),
    "ingest": (["--ingest", "stream"], "--ingest auto -> stream"),
    "memory_ingest_limit_mb": (["--memory-ingest-limit-mb", "10"], "--memory-ingest-limit-mb 1024.0 -> 10.0"),
    "shuffle_window_rows": (["--shuffle-window-rows", "100"], "--shuffle-window-rows 65536 -> 100"),
}
BASE = [
    "--model",
    "seed-mlp",
    "--hidden",
    "8",
    "--epochs",
    "3",
    "--batch-size",
    "16",
    "--seed",
    "11",
    "--momentum",
    "0.9",
    "--name",
    "run",
]


def test_every_setting_is_classified():
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(FIXED + GROWABLE + OPERATIONAL)
    assert set(CHANGES) == set(FIXED)


@pytest.fixture
def started(regression_data, tmp_path):
    """A run that completed 2 of 3 epochs: its run.json and its checkpoints, as a strategy leaves them."""
    argv = [*BASE, "--data", regression_data, "--storage-path", str(tmp_path / "runs")]
    cfg = TrainConfig(
        model="seed-mlp",
        hidden=8,
        epochs=3,
        batch_size=16,
        seed=11,
        momentum=0.9,
        name="run",
        data=regression_data,
        storage_path=str(tmp_path / "runs"),
    )
    prepared = prepare(cfg, "ddp")
    for epochs in (1, 2):
        write_checkpoint(
            os.path.join(prepared.run_dir, checkpoint_name(epochs)),
            TrainState(prepared.initial_state, {}, epochs, [1.0] * epochs),
        )
    return argv, cfg, prepared.run_dir


def snapshot(run_dir: str) -> dict[str, tuple[int, bytes]]:
    files = {}
    for root, _, names in os.walk(run_dir):
        for name in names:
            path = os.path.join(root, name)
            files[path] = (os.stat(path).st_mtime_ns, open(path, "rb").read())
    return files


# The pipeline refuses --grad-accum-steps itself (it accumulates over its micro-batches).
PAIRS = [(s, k) for s in sorted(ENTRY_POINTS) for k in sorted(CHANGES) if (s, k) != ("pipeline", "grad_accum_steps")]


@pytest.mark.parametrize(("strategy", "setting"), PAIRS)
def test_a_changed_setting_is_refused_naming_it(started, strategy, setting, tmp_path, capsys):
    argv, cfg, run_dir = started
    other = str(tmp_path / "other.parquet")
    init = str(tmp_path / "init.pt")
    flags, named = CHANGES[setting]
    flags = [{"OTHER": other, "INIT": init}.get(flag, flag) for flag in flags]
    before = snapshot(run_dir)
    assert ENTRY_POINTS[strategy]([*argv, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: run 'run' was started with other settings: ")
    assert named.format(data=cfg.data, other=other, init=init) in err
    assert f"--init-from {run_dir}/{checkpoint_name(2)}/checkpoint.pt --name NEW_NAME" in err
    assert snapshot(run_dir) == before  # nothing in the run directory changed


def test_every_difference_is_listed_at_once(started, capsys):
    argv, _, _ = started
    assert ddp.main([*argv, "--lr", "0.5", "--momentum", "0.0", "--weight-decay", "0.1"]) == 2
    assert "--lr 0.05 -> 0.5, --momentum 0.9 -> 0.0, --weight-decay 0.0 -> 0.1." in capsys.readouterr().err


def test_operational_flags_and_more_epochs_may_change(started):
    _, cfg, run_dir = started
    changed = dataclasses.replace(
        cfg,
        epochs=5,
        max_failures=2,
        resource_timeout=5.0,
        checkpoint_every=2,
        checkpoint_every_steps=3,
        num_checkpoints_to_keep=4,
        data=os.path.relpath(cfg.data),
    )  # same file
    assert check_rerun(changed, "run", run_dir) == 2


def test_fewer_epochs_than_completed_is_refused(started, capsys):
    argv, _, _ = started
    assert pipeline.main([*argv, "--epochs", "1"]) == 2
    assert "error: --epochs 1 is fewer than the 2 epochs run 'run' has completed" in capsys.readouterr().err


def test_a_finished_run_rerun_with_its_settings_is_already_complete(started, capsys):
    argv, cfg, run_dir = started
    write_checkpoint(os.path.join(run_dir, checkpoint_name(3)), TrainState({}, {}, 3, [1.0] * 3))
    for name in ("model.pt", "summary.json"):
        with open(os.path.join(run_dir, name), "w") as file:
            file.write(json.dumps({"epochs_completed": 3}))
    before = snapshot(run_dir)
    assert dp.main(argv) == 0
    assert "run 'run' is already complete (3 of 3 epochs)" in capsys.readouterr().out
    assert snapshot(run_dir) == before
    with pytest.raises(AlreadyComplete):
        prepare(cfg, "pipeline")


def test_a_run_that_never_checkpointed_takes_the_new_settings(regression_data, tmp_path):
    cfg = TrainConfig(data=regression_data, batch_size=16, storage_path=str(tmp_path), name="run")
    run_dir = prepare(cfg, "ddp").run_dir
    prepare(dataclasses.replace(cfg, lr=0.5), "ddp")  # nothing was trained under the first settings
    assert json.loads(open(os.path.join(run_dir, RUN_FILE)).read())["settings"]["lr"] == 0.5


def test_checkpoints_without_a_run_record_resume_with_a_warning(started, capsys):
    _, cfg, run_dir = started
    os.remove(os.path.join(run_dir, RUN_FILE))
    assert check_rerun(dataclasses.replace(cfg, lr=0.5), "run", run_dir) == 2
    assert "no run.json" in capsys.readouterr().err


def test_rerun_check_reads_no_checkpoint(started, monkeypatch):
    """Names carry the progress: a large model's checkpoint is not loaded on the driver to check flags."""
    _, cfg, run_dir = started
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a checkpoint was loaded"))
    assert check_rerun(cfg, "run", run_dir) == 2


def test_outputs_an_earlier_shorter_run_left_are_not_complete(started, capsys):
    """--epochs 2 wrote model.pt and summary.json; --epochs 4 was stopped after epoch 3's checkpoint;
    --epochs 3 must not call the 2-epoch outputs complete: it writes them anew from that checkpoint."""
    argv, cfg, run_dir = started
    write_checkpoint(os.path.join(run_dir, checkpoint_name(3)), TrainState({}, {}, 3, [1.0] * 3))
    with open(os.path.join(run_dir, "model.pt"), "w") as file:
        file.write("the 2-epoch weights")
    for written, complete in ((2, False), ("junk", False), (3, True)):
        with open(os.path.join(run_dir, "summary.json"), "w") as file:
            file.write(json.dumps({"epochs_completed": written}) if written != "junk" else "{not json")
        if complete:
            with pytest.raises(AlreadyComplete):
                check_rerun(cfg, "run", run_dir)
        else:
            assert check_rerun(cfg, "run", run_dir) == 3
