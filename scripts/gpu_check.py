"""GPU readiness: DDP over nccl, DataParallel over every GPU, the pipeline with nccl channels.

Run on a machine with GPUs, from the repo root: ``python scripts/gpu_check.py``. Each strategy
trains the same small model as a single-process CPU reference and must end with the same
weights; the script prints one table and exits non-zero if any check fails.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_jobs import ddp, dp
from ray_jobs.core.config import TrainConfig, WorkerScaling
from ray_jobs.data.parquet import read_dataset, synthesize, write_table
from ray_jobs.driver.connect import connect
from ray_jobs.driver.prepare import prepare
from ray_jobs.pipeline import trainer as pipeline  # noqa: E402
from tests.reference import reference_train  # noqa: E402

# GPU kernels sum in another order than the CPU reference (and nccl all-reduce in another
# order than one full-batch mean): float32 rounding over a few dozen steps, TF32 off.
RTOL, ATOL = 1e-4, 1e-5


def reference(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    dataset = read_dataset(cfg.data)
    weights, _ = reference_train(
        model=cfg.model,
        features=torch.from_numpy(dataset.features.copy()),
        targets=torch.from_numpy(dataset.targets.copy()),
        out_features=dataset.out_features,
        epochs=cfg.epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        hidden=cfg.hidden,
    )
    return weights


def matches(run_dir: str, expected: dict[str, torch.Tensor]) -> str:
    got = torch.load(f"{run_dir}/model.pt", weights_only=True)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    ok = all(torch.allclose(got[k], expected[k], rtol=RTOL, atol=ATOL) for k in expected)
    return f"{'yes' if ok else 'NO'} (max |diff| {worst:.1e})"


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    num_gpus = torch.cuda.device_count()
    if num_gpus == 0:
        print("no GPU visible: nothing to check")
        return 2
    connect()
    work = Path(tempfile.mkdtemp(prefix="raypar-gpu-"))
    data = str(work / "data.parquet")
    write_table(synthesize(4096, 64, 8, "regression", seed=0), data)
    cfg = TrainConfig(
        model="seed-mlp", hidden=256, data=data, epochs=3, batch_size=64, seed=0, storage_path=str(work), lr=0.05
    )
    expected = reference(cfg)
    stages = min(num_gpus, 2)

    def pipe(transport: str):
        scaling = pipeline.PipelineScaling(num_stages=stages, num_microbatches=4, use_gpu=True, transport=transport)
        return lambda c: pipeline.run(prepare(c, "pipeline"), scaling)

    runs = [
        ("ddp", "ddp (nccl)", lambda c: ddp.run(prepare(c, "ddp"), WorkerScaling(num_workers=num_gpus, use_gpu=True))),
        ("dp", "dp (all GPUs)", lambda c: dp.run(prepare(c, "dp"), dp.DataParallelScaling(gpus=num_gpus))),
        ("pipe-compiled", f"pipeline S={stages} (compiled, nccl)", pipe("compiled")),
        ("pipe-p2p", f"pipeline S={stages} (p2p, gloo)", pipe("p2p")),
    ]
    rows, failed = [], False
    for name, label, run in runs:
        try:
            summary = run(TrainConfig(**{**vars(cfg), "name": name}))
            verdict = matches(summary.run_dir, expected)
            rows.append((label, summary.world_size, f"{summary.samples_per_second:,.0f}", verdict))
            failed |= verdict.startswith("NO")
        except Exception as error:  # report every strategy, not just the first failure
            rows.append((label, "-", "-", f"FAILED: {str(error).splitlines()[0][:80]}"))
            failed = True
    print(f"\n{num_gpus} GPU(s): {torch.cuda.get_device_name(0)}; torch {torch.__version__}, ray {ray.__version__}")
    print(f"{'strategy':<32} {'world':>5} {'samples/s':>12}  same weights as the CPU reference")
    for label, world, speed, verdict in rows:
        print(f"{label:<32} {world!s:>5} {speed:>12}  {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
