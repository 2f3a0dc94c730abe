"""The layouts case: four processes laid five ways on the suite's gpt, at one global batch, side
by side: DDP on 4 workers, HSDP (fsdp, shard groups of 2), the pipeline on 4 stages, DP x PP
(2 replicas of 2 stages) and FSDP x PP (each of 2 stages sharded over its 2 copies). Tokens/s
of each, as a ratio to DDP's, from one run each (the repetitions of ``fit_repetitions``).

On a machine with fewer cores than the four processes (this 2-CPU VM) they share the cores:
the ratios then measure each layout's overhead (its collectives, its bubble, its process count),
not how it scales. Scaling belongs to a cluster (``--suite full --address``).

Each run also counts the bytes its processes hand to collectives and sends per step
(``--count-comm-bytes``), set beside what the communication model's ``handed`` says they are:
the check that the model's inputs are what raypar's layouts really move. Counting costs a Python
call per collective (DDP's through a communication hook), the same for every layout.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ray_jobs.bench.cases.comm_model import Params, handed
from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.cases.lm import per_token, write_lm_tokens
from ray_jobs.bench.stats import ratio, steady, summarise
from ray_jobs.driver.prepare import prepare

PROCESSES = 4
CPUS_EACH = 0.5  # four processes on the test cluster's logical CPUs, with room left for Ray's own actors
LAYOUTS = ("ddp", "hsdp", "pipeline", "dp_x_pp", "fsdp_x_pp")


def layouts_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    work = bench.suite.lm
    data = write_lm_tokens(os.path.join(bench.out, "data", "layouts.parquet"), work.rows, work.block_size)
    microbatches = bench.suite.target_microbatches
    raw: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    for rep in range(bench.suite.fit_repetitions):
        for layout in LAYOUTS:  # interleaved: the machine's drift falls on every layout
            bench.measure(raw[layout], f"layout {layout}", rep, lambda layout=layout: _run(bench, layout, data))
    figures = {
        layout: per_token(summarise(runs)["samples_per_second"], work.block_size) for layout, runs in raw.items()
    }
    params = _params(bench.config(work, data, "layout-shape"))
    row_activation = work.block_size * work.n_embd
    comm = {
        layout: {
            "model": handed(layout, params, PROCESSES, work.batch_size, row_activation),
            "measured": runs[-1]["comm_bytes_per_step"],
        }
        for layout, runs in raw.items()
    }
    return {
        "workload": dataclasses.asdict(work),
        "processes": PROCESSES,
        "num_microbatches": microbatches,
        "tokens_per_second": figures,
        "over_ddp": {layout: ratio(figures[layout], figures["ddp"]) for layout in LAYOUTS},
        "comm_bytes_per_step": comm,
        "comm_agreement": comm_agreement(comm),
        "raw": raw,
    }


def _run(bench: Bench, layout: str, data: str) -> dict[str, Any]:
    from ray_jobs import ddp
    from ray_jobs.core.config import WorkerScaling
    from ray_jobs.data_parallel import fsdp
    from ray_jobs.pipeline import trainer as pipeline

    work = bench.suite.lm
    strategy = {"ddp": "ddp", "hsdp": "fsdp"}.get(layout, "pipeline")
    cfg = dataclasses.replace(bench.config(work, data, f"layout-{layout}"), count_comm_bytes=True)
    prepared = prepare(cfg, strategy)
    workers = {"num_workers": PROCESSES, "cpus_per_worker": CPUS_EACH}
    if layout == "ddp":
        summary = ddp.run(prepared, WorkerScaling(**workers))
    elif layout == "hsdp":
        summary = fsdp.run(prepared, fsdp.ShardedScaling(**workers, shard_group_size=PROCESSES // 2))
    else:
        replicas = 1 if layout == "pipeline" else 2
        scaling = pipeline.PipelineScaling(
            num_stages=PROCESSES // replicas,
            num_microbatches=bench.suite.target_microbatches,
            data_parallel=replicas,
            stage_sharding="fsdp" if layout == "fsdp_x_pp" else "none",
            cpus_per_stage=CPUS_EACH,
        )
        summary = pipeline.run(prepared, scaling)
    bench.clean(prepared.run_dir)
    counted = summary.extra["worker_comm_bytes_per_step" if strategy != "pipeline" else "stage_comm_bytes_per_step"]
    return {
        "samples_per_second": steady(summary.extra["epoch_seconds"], work.samples_per_epoch),
        "comm_bytes_per_step": {kind: sum(process[kind] for process in counted) for kind in counted[0]},
    }


def _params(cfg) -> Params:
    """The gpt's parameters as FSDP2 groups them, read from the model built on the meta device."""
    from ray_jobs.core.model_init import meta_model
    from ray_jobs.core.shard_plan import shard_units
    from ray_jobs.driver.prepare import load_data

    model = meta_model(cfg, load_data(cfg))
    *resharded, last = [model.get_submodule(name) for name in shard_units(model)]
    in_resharded = {id(p) for unit in resharded for p in unit.parameters()}
    shapes: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for param in model.parameters():  # each shared parameter once; the last unit's and the root's are kept
        shapes[id(param) in in_resharded].append((param.shape[0] if param.dim() else 1, param.numel()))
    return Params(resharded=tuple(shapes[True]), kept=tuple(shapes[False]))


def comm_agreement(comm: dict[str, dict[str, dict[str, float]]]) -> float:
    """The largest relative gap between a measured count and the model's, over every layout and
    kind the model gives; 0 is exact. A kind the model says is unused must be counted as 0."""
    gaps = []
    for sides in comm.values():
        for kind, expected in sides["model"].items():
            measured = sides["measured"].get(kind, 0.0)
            gaps.append(abs(measured - expected) / expected if expected else float(measured != 0))
    return max(gaps)
