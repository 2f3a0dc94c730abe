"""Entry points: bad input is one ``error:`` line and a non-zero exit, before Ray is touched."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from models import build_model
from ray_jobs import ddp, dp, fsdp
from tests.helpers import REPO

BAD_INPUT = [
    (["--num-workers", "0"], "error: --num-workers must be at least 1, got 0"),
    (
        ["--num-workers", "4", "--batch-size", "3"],
        "error: --batch-size 3 is smaller than --num-workers 4: every worker",
    ),
    (["--num-workers", "2", "--min-workers", "3"], "error: --min-workers must be between 1 and --num-workers 2, got 3"),
    (["--min-workers", "1"], "error: --min-workers 1 needs --max-failures of at least 1"),
    (["--resize-interval", "5"], "error: --resize-interval applies to an elastic run: give --min-workers"),
    (
        ["--min-workers", "1", "--max-failures", "1", "--resize-interval", "0"],
        "error: --resize-interval must be positive, got 0.0",
    ),
    (["--model", "vit"], "error: --model 'vit' is unknown; valid models: gpt, mlp, seed-linear, seed-mlp, seed-split"),
    (["--model", "seed-linear", "--hidden", "4"], "error: model 'seed-linear' does not take --hidden"),
    (["--epochs", "-1"], "error: --epochs must be at least 1, got -1"),
    (["--placement-strategy", "ANY"], "error: --placement-strategy 'ANY' is unknown"),
    (["--data", "/nonexistent/data.parquet"], "error: --data /nonexistent/data.parquet: no such file or directory"),
    (["--batch-size", "4096"], "error: the dataset has 1024 rows, fewer than one global batch (--batch-size 4096)"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_INPUT)
def test_ddp_bad_input(argv, message, capsys, tmp_path):
    assert ddp.main([*argv, "--storage-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing a later resume could trust


def test_argparse_errors_exit_2_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        dp.main(["--gpus", "x"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m ray_jobs.dp: error: argument --gpus: invalid int value: 'x' (see --help)"
    ]


def test_init_from_that_does_not_match_the_model(tmp_path, capsys):
    weights = tmp_path / "other.pt"
    torch.save(build_model("seed-mlp", 10, 5, hidden=3).state_dict(), weights)
    assert dp.main(["--init-from", str(weights), "--storage-path", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert "error: --init-from" in err and "does not match --model seed-mlp with 10 inputs and 5 outputs" in err
    (tmp_path / "junk.pt").write_text("junk")
    assert dp.main(["--init-from", str(tmp_path / "junk.pt")]) == 2
    assert "not a torch state_dict" in capsys.readouterr().err


def test_fsdp_refuses_fp16_and_a_sharded_checkpoint_as_initial_weights_in_one_line(tmp_path, capsys):
    assert fsdp.main(["--precision", "fp16", "--use-gpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --precision fp16 is not offered with fsdp: its gradient scaler would check each rank's own "
        "shard for overflow, so ranks could skip different steps; use --precision bf16"
    ]
    sharded = tmp_path / "checkpoint.pt"
    torch.save({"model": {}, "optimizer": {}, "epochs_completed": 1, "sharded": True}, sharded)
    assert fsdp.main(["--init-from", str(sharded), "--storage-path", str(tmp_path / "runs")]) == 2
    assert "keeps its weights in shards beside it; start from the run's model.pt" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-workers", "4", "--shard-group-size", "3"], "error: --shard-group-size 3 does not divide 4 worker(s)"),
        (
            ["--num-workers", "4", "--min-workers", "2", "--max-failures", "1", "--shard-group-size", "2"],
            "error: --shard-group-size 2 does not divide 3 worker(s): give a group size that divides --num-workers "
            "(and, for an elastic run, every count from --min-workers up)",
        ),
        (["--shard-group-size", "0"], "error: --shard-group-size must be at least 1, got 0"),
    ],
)
def test_fsdp_refuses_a_shard_group_size_that_does_not_divide_the_workers(argv, message, capsys):
    assert fsdp.main(argv) == 2
    assert capsys.readouterr().err.startswith(message)


def test_fsdp_help_lists_its_flags_with_their_defaults(capsys):
    with pytest.raises(SystemExit):
        fsdp.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-reshard-after-forward" in text and "(default: on)" in text
    assert "--activation-checkpointing" in text


def test_unwritable_storage_path(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert ddp.main(["--storage-path", str(blocker / "runs")]) == 2
    assert "error: --storage-path" in capsys.readouterr().err


def test_a_real_process_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ray_jobs.ddp", "--num-workers", "3", "--batch-size", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --batch-size 2 is smaller than --num-workers 3: every worker needs at "
        "least one row of each global batch"
    )
    assert "Traceback" not in result.stdout + result.stderr


HELP_SECTIONS = {
    "ddp": ["data", "model", "training", "placement", "checkpoints", "ingest"],
    "dp": ["data", "model", "training", "placement", "checkpoints", "ingest"],
    "pipeline": ["data", "model", "training", "pipeline", "placement", "checkpoints", "ingest"],
}


@pytest.mark.parametrize("strategy", sorted(HELP_SECTIONS))
def test_help_groups_flags_as_the_readme_does_each_with_its_default(strategy, capsys):
    from ray_jobs.pipeline import trainer as pipeline

    module = {"ddp": ddp, "dp": dp, "pipeline": pipeline}[strategy]
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    sections = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert sections[sections.index("data") :] == HELP_SECTIONS[strategy]
    for flag in text.split("\n  --")[1:]:
        assert "(default: " in " ".join(flag.split()), flag  # argparse wraps a flag's help: join it
    readme = (REPO / "README.md").read_text()
    for section in HELP_SECTIONS[strategy]:
        assert f"| {section}" in readme, section  # the README's flag reference uses the same groups


def test_auto_task_says_what_it_chose_and_why(classification_data, tmp_path, capsys):
    from ray_jobs.core.config import TrainConfig
    from ray_jobs.driver.prepare import prepare

    prepare(TrainConfig(data=classification_data, batch_size=16, storage_path=str(tmp_path)), "ddp")
    assert (
        "[raypar] task: classification (column 'target' holds integers; 4 classes from the files' "
        "raypar.num_classes; --task to choose)"
    ) in capsys.readouterr().out


NOT_NAMES = ["..", ".", "a/b", "../escape", "-x", ".hidden", "a b", "a\x00b", "a?b", "x" * 201]


@pytest.mark.parametrize("name", NOT_NAMES, ids=lambda name: repr(name)[:12])
def test_a_run_name_is_one_safe_path_component(name, tmp_path, capsys):
    storage = tmp_path / "runs"
    assert ddp.main([f"--name={name}", "--storage-path", str(storage)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --name {name!r} is not a run name: use letters, digits")
    assert sorted(path.name for path in tmp_path.iterdir()) == []  # nothing written, inside or out


def test_a_run_directory_that_resolves_outside_the_storage_path_is_refused(tmp_path, capsys):
    storage, outside = tmp_path / "runs", tmp_path / "elsewhere"
    storage.mkdir()
    outside.mkdir()
    (storage / "linked").symlink_to(outside)
    assert ddp.main(["--name", "linked", "--storage-path", str(storage)]) == 2
    assert f"error: --name: {storage / 'linked'} is not inside the storage path {storage}" in capsys.readouterr().err
    assert not any(outside.iterdir())
    assert dp.main(["--name", "x" * 200, "--storage-path", str(storage), "--epochs", "0"]) == 2  # 200 is a name
    assert "--epochs must be at least 1" in capsys.readouterr().err


def test_a_model_from_a_module_without_a_file_is_one_line(tmp_path, capsys):
    assert ddp.main(["--model", "builtins:print", "--storage-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --model builtins:print: (10, 5) returned NoneType, not a torch.nn.Module"]


def test_a_run_record_without_settings_is_one_line(tmp_path, capsys):
    from ray_jobs.core.checkpoint import TrainState, checkpoint_name, write_checkpoint

    run_dir = tmp_path / "run"
    write_checkpoint(str(run_dir / checkpoint_name(1)), TrainState({}, {}, 1, [1.0]))
    (run_dir / "run.json").write_text('{"strategy": "ddp"}')
    assert ddp.main(["--name", "run", "--storage-path", str(tmp_path), "--epochs", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {run_dir / 'run.json'} is not a raypar run record (no settings): restore it, or start "
        "the run under a new --name"
    ]


def test_dp_refuses_compile_on_several_gpus_in_one_line(capsys):
    assert dp.main(["--compile", "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --compile with dp on more than one GPU")


@pytest.mark.parametrize(
    ("stopped", "started_here", "calls"),
    [
        (False, False, ["shutdown", "exit 130"]),
        (False, True, ["shutdown", "exit 130"]),
        (True, False, ["exit 130"]),
        (True, True, ["end local ray", "exit 130"]),
    ],
)
def test_a_stopped_run_exits_without_tearing_ray_down_under_its_threads(monkeypatch, stopped, started_here, calls):
    """After Ctrl-C the fit's thread can still be inside ``ray.get``: ``ray.shutdown()`` under it
    crashed the process (SIGSEGV, exit -11 for 130). The process then ends without it, and Ray
    ends the driver's actors with the process (tests/ray/test_interrupts.py)."""
    from ray_jobs.driver import entry, interrupts

    made: list[str] = []
    monkeypatch.setattr(entry.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(entry.ray, "shutdown", lambda: made.append("shutdown"))
    monkeypatch.setattr(entry.os, "_exit", lambda code: made.append(f"exit {code}"))
    monkeypatch.setattr(interrupts.STOP, "is_set", lambda: stopped)
    monkeypatch.setattr(entry, "ray_started_here", lambda: started_here)
    monkeypatch.setattr(entry, "end_local_ray_now", lambda: made.append("end local ray"))
    entry.exit_process(130)
    assert made == calls


def test_ending_a_local_ray_kills_what_its_daemons_started_and_leaves_the_daemons_to_die_with_the_driver(
    monkeypatch,
):
    """The daemons go with the driver's process (fate-sharing); killing them first would race its
    exit status. What they started (the raylet's agents, which otherwise linger ~60 s) is killed."""
    import psutil

    from ray_jobs.driver import connect

    daemon = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    started = psutil.Process(daemon.pid)
    deadline = time.monotonic() + 10
    while len(started.children()) < 2:
        assert time.monotonic() < deadline, "sh did not start its two sleeps"
        time.sleep(0.01)
    below = started.children()
    monkeypatch.setattr(connect, "_local_daemons", [started])
    connect.end_local_ray_now()
    gone, alive = psutil.wait_procs(below, timeout=10)
    assert not alive and {process.returncode for process in gone} <= {None, -9}
    assert daemon.wait(timeout=10) == 0  # the daemon was not signalled: its `wait` returned normally
