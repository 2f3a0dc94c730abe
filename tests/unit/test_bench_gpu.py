"""``--suite gpu`` without a GPU: its cases registered, its refusal on CPU, and its aggregation,
targets and report run on canned measurements (no Ray, no GPU)."""

from __future__ import annotations

import itertools

import pytest

from ray_jobs.bench.cases import CASES, gpu, suite_cases
from ray_jobs.bench.report import render
from ray_jobs.bench.run import main
from ray_jobs.bench.stats import targets
from ray_jobs.bench.suites import SUITES


def test_the_gpu_cases_are_registered_for_the_gpu_suite_only():
    assert suite_cases("gpu") == ["gpu_data_parallel", "gpu_precision", "gpu_pipeline"]
    assert all(name in CASES for name in suite_cases("gpu"))
    assert not set(suite_cases("quick")) & set(suite_cases("gpu"))
    assert (
        suite_cases("quick")
        == suite_cases("full")
        == ["data_parallel", "pipeline", "ingest", "stage_memory", "stream_ingest", "accumulation", "lm", "sharding"]
        + ["pretrained", "layouts", "checkpoint", "tokenize", "comm_model"]
    )
    work = SUITES["gpu"].ddp  # issue #22's compute-bound MLP: 256 -> 2048 x6 -> 16, batch 4096
    assert (work.in_features, work.hidden, work.depth, work.out_features, work.batch_size) == (256, 2048, 7, 16, 4096)


@pytest.mark.parametrize("argv", [["--suite", "gpu"], ["--suite", "quick", "--cases", "gpu_precision"]])
def test_the_gpu_suite_on_a_machine_without_cuda_is_one_error_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main([*argv, "--out", str(tmp_path / "bench")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --suite gpu needs a CUDA GPU")
    assert not (tmp_path / "bench").exists()  # nothing measured, nothing written


class FakeBench:
    """Canned runs: each measured figure a fresh number, so every ratio has something to divide."""

    suite = SUITES["gpu"]
    ddp_data = pipeline_data = "unused"

    def __init__(self) -> None:
        self.counter = itertools.count(1)

    def log(self, _line: str) -> None:
        pass

    def measure(self, into, _label, _rep, run) -> None:
        into.append(run())

    def run(self, **extra):
        value = 1000.0 * next(self.counter)
        return {"samples_per_second": [value, value * 1.01], "final_loss": 0.5, "epoch_losses": [0.9, 0.5], **extra}

    def peer(self, *_args, **_kwargs):
        return self.run()


def test_the_gpu_cases_aggregate_judge_and_render_canned_runs(monkeypatch):
    bench = FakeBench()
    monkeypatch.setattr(gpu, "cluster_gpus", lambda: 2)
    monkeypatch.setattr(gpu, "raypar_data_parallel", lambda *_a, **_k: bench.run())
    monkeypatch.setattr(gpu, "run_gpu_pipeline", lambda *_a, **_k: bench.run(transport="p2p_gloo"))
    results = {
        "suite": "gpu",
        "seconds": 1.0,
        "machine": {
            "cpu_count": 16,
            "torch": "t",
            "ray": "r",
            "python": "p",
            "platform": "linux",
            "gpus": ["NVIDIA H200", "NVIDIA H200"],
            "cuda": "13.0",
        },
    }
    for name in suite_cases("gpu"):
        results[name] = CASES[name](bench, results)
    assert [p["num_gpus"] for p in results["gpu_data_parallel"]["points"]] == [1, 2]
    assert results["gpu_pipeline"]["gpus_per_stage"] == 1.0  # two GPUs: a stage each
    results["targets"], results["plots"] = targets(results), []
    assert [t["name"].split(":")[0] for t in results["targets"]] == [
        "GPU DDP 1 GPU",
        "GPU DDP 2 GPU",
        "GPU bf16 / fp32 samples/s, raypar DDP 1 GPU",
    ]
    assert all(t["status"] in ("met", "missed", "within noise") for t in results["targets"])
    report = render(results)
    assert "2 GPU (NVIDIA H200, CUDA 13.0)" in report and "## GPU 3. The pipeline over GPUs" in report
    assert "bf16 / fp32 final loss (raypar) 1.000" in report


def test_one_gpu_makes_the_pipeline_stages_share_it(monkeypatch):
    bench = FakeBench()
    monkeypatch.setattr(gpu, "cluster_gpus", lambda: 1)
    monkeypatch.setattr(gpu, "run_gpu_pipeline", lambda *_a, **_k: bench.run(transport="p2p_gloo"))
    assert CASES["gpu_pipeline"](bench, {})["gpus_per_stage"] == 0.5


def test_the_gpu_cases_refuse_a_cluster_without_gpus(monkeypatch):
    monkeypatch.setattr(gpu, "cluster_gpus", lambda: 0)
    with pytest.raises(ValueError, match="the GPU cases need a Ray cluster with GPUs"):
        CASES["gpu_precision"](FakeBench(), {})
