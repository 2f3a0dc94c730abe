"""``--suite gpu`` without a GPU: its cases registered, its refusal on CPU, and its aggregation,
targets and report run on canned measurements (no Ray, no GPU)."""

from __future__ import annotations

import itertools

import pytest

from ray_jobs.bench.cases import CASES, gpu, gpu_lm, suite_cases
from ray_jobs.bench.report import render
from ray_jobs.bench.run import main
from ray_jobs.bench.stats import targets
from ray_jobs.bench.suites import SUITES


def test_the_gpu_cases_are_registered_for_the_gpu_suite_only():
    assert suite_cases("gpu") == ["gpu_data_parallel", "gpu_precision", "gpu_pipeline", "gpu_lm"]
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
    ddp_data = pipeline_data = out = "unused"

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
    for name, value in (
        ("require_gpus", 2),
        ("write_lm_tokens", "unused"),
        ("_flops_per_token", 6e8),
        ("_peak", 989.0),
    ):
        monkeypatch.setattr(gpu_lm, name, lambda *_a, value=value, **_k: value)
    monkeypatch.setattr(gpu_lm, "raypar_data_parallel", lambda *_a, **_k: bench.run())
    monkeypatch.setattr(gpu_lm, "_fsdp", lambda *_a, **_k: bench.run())
    monkeypatch.setattr(gpu_lm.os, "remove", lambda _path: None)
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
    assert results["gpu_lm"]["workload"]["batch_size"] == 32 and "## GPU 4. A GPT-2-small shape" in report


def test_one_gpu_makes_the_pipeline_stages_share_it(monkeypatch):
    bench = FakeBench()
    monkeypatch.setattr(gpu, "cluster_gpus", lambda: 1)
    monkeypatch.setattr(gpu, "run_gpu_pipeline", lambda *_a, **_k: bench.run(transport="p2p_gloo"))
    assert CASES["gpu_pipeline"](bench, {})["gpus_per_stage"] == 0.5


def test_the_gpu_cases_refuse_a_cluster_without_gpus(monkeypatch):
    monkeypatch.setattr(gpu, "cluster_gpus", lambda: 0)
    with pytest.raises(ValueError, match="the GPU cases need a Ray cluster with GPUs"):
        CASES["gpu_precision"](FakeBench(), {})


def test_the_gpu_lm_case_gives_each_sides_tokens_per_second_and_mfu():
    from ray_jobs.bench.cases.gpu_lm import gpu_lm_figures
    from ray_jobs.bench.report_gpu import gpu_sections
    from ray_jobs.bench.suites import LmWorkload

    work = LmWorkload(n_layer=12, n_head=12, n_embd=768, block_size=1024, rows=1024, batch_size=16, epochs=3)
    raw = {
        "raypar_ddp": [{"samples_per_second": [100.0]}],
        "torch_ddp": [{"samples_per_second": [104.0]}],
        "raypar_fsdp": [{"samples_per_second": [90.0]}],
    }
    case = gpu_lm_figures(raw, work, num_gpus=1, flops=6e8, peak=989.0)
    assert case["tokens_per_second"]["raypar_ddp"]["median"] == 102_400
    assert case["mfu"]["raypar_ddp"]["median"] == pytest.approx(102_400 * 6e8 / 989e12)
    assert case["fsdp_over_ddp"]["median"] == pytest.approx(0.9)
    text = "\n".join(gpu_sections({"gpu_lm": case}))
    assert "| raypar DDP " in text and "6.2%" in text and "raypar FSDP / raypar DDP: 0.900" in text
    assert "MFU" in text and gpu_lm_figures(raw, work, 1, 6e8, None)["mfu"]["raypar_ddp"] is None
