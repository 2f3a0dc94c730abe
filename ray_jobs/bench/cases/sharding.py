"""The sharding case: FSDP against DDP on the same gpt, tokens, workers and AdamW, side by side, at
each of the suite's widths: each worker's model-state memory (parameters, gradients, optimizer
state) and samples/s, so the curve shows where a step's compute outweighs FSDP's extra
collectives; and the GPT's activation memory with and without ``--activation-checkpointing``.

Model-state bytes are counted inside each worker after its last step, from the tensors it holds
(``observability.model_memory``: an FSDP parameter's local shard, its gradient and optimizer
state; each storage once), not from RSS; DDP's gradient buckets are not counted. Activation bytes
are what autograd holds for backward when the GPT's forward ends (``core.activations.
HeldForBackward``, saved-tensor hooks), measured in the bench's own process, no Ray.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

from models import build_model
from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.cases.data_parallel import max_workers
from ray_jobs.bench.cases.lm import write_lm_tokens
from ray_jobs.bench.stats import ratio, stats, steady, summarise
from ray_jobs.bench.suites import GPTShape, LmWorkload
from ray_jobs.core.activations import HeldForBackward, checkpoint_activations

STRATEGIES = ("ddp", "fsdp")
# AdamW: the optimizer state is twice the weights, the case FSDP is for (~16 bytes a parameter with DDP).
OPTIMIZER = {"optimizer": "adamw", "lr": 1e-3}
GPT_STEPS = 3  # forward and backward per side; the first is the warm-up


def sharding_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    work = bench.suite.sharding
    data = write_lm_tokens(os.path.join(bench.out, "data", "sharding.parquet"), work.rows, work.block_size)
    num_workers = max(n for n in range(1, min(bench.suite.ddp_workers, max_workers()) + 1) if work.batch_size % n == 0)
    widths = [
        _width(bench, dataclasses.replace(work, n_embd=n), data, num_workers) for n in bench.suite.sharding_widths
    ]
    os.remove(data)
    bench.log("[bench] activation memory: the GPT with and without --activation-checkpointing")
    widest = widths[-1]  # the suite's own width: the case's figures
    return {
        "workload": {**asdict(dataclasses.replace(work, n_embd=widest["n_embd"])), **OPTIMIZER},
        "num_workers": num_workers,
        **{key: widest[key] for key in WIDTH_FIGURES},
        "widths": [{key: width[key] for key in ("n_embd", "parameters", *WIDTH_FIGURES)} for width in widths],
        "activations": activation_memory(bench.suite.gpt),
        "raw": widest["raw"],
    }


WIDTH_FIGURES = (
    "model_state_bytes",
    "model_state_ratio",
    "samples_per_second",
    "samples_per_second_ratio",
    "peak_rss_bytes",
)


def _width(bench: Bench, work: LmWorkload, data: str, num_workers: int) -> dict[str, Any]:
    """FSDP and DDP on the gpt at ``work.n_embd``, their fits interleaved."""
    raw: dict[str, list[dict]] = {strategy: [] for strategy in STRATEGIES}
    state: dict[str, list[dict[str, int]]] = {}  # per world rank; the same bytes in every repetition
    for rep in range(bench.suite.fit_repetitions):
        for strategy in STRATEGIES:  # interleaved: the machine's drift falls on both sides
            bench.measure(
                raw[strategy],
                f"raypar {strategy} {num_workers} workers, gpt width {work.n_embd}, AdamW",
                rep,
                lambda strategy=strategy: _fit(bench, work, data, strategy, num_workers, state),
            )
    figures = {strategy: summarise(runs) for strategy, runs in raw.items()}
    most = {strategy: max(worker["total"] for worker in state[strategy]) for strategy in STRATEGIES}
    return {
        "n_embd": work.n_embd,
        "parameters": state["ddp"][0]["parameters"] // 4,  # DDP holds them all, in fp32
        "model_state_bytes": state,
        "model_state_ratio": most["fsdp"] / most["ddp"],
        "samples_per_second": {strategy: figures[strategy]["samples_per_second"] for strategy in STRATEGIES},
        "samples_per_second_ratio": ratio(figures["fsdp"]["samples_per_second"], figures["ddp"]["samples_per_second"]),
        "peak_rss_bytes": {strategy: figures[strategy]["peak_rss_bytes"] for strategy in STRATEGIES},
        "raw": raw,
    }


def _fit(
    bench: Bench, work: LmWorkload, data: str, strategy: str, num_workers: int, state: dict[str, list[dict[str, int]]]
) -> dict[str, Any]:
    cfg = dataclasses.replace(bench.config(work, data, f"{strategy}{num_workers}"), **OPTIMIZER)
    summary = bench.fit_workers(cfg, strategy, num_workers)
    state[strategy] = summary.extra["worker_model_state_bytes"]
    return {
        "samples_per_second": steady(summary.extra["epoch_seconds"], work.samples_per_epoch),
        "peak_rss_bytes": max(summary.extra["worker_peak_rss_bytes"]),
    }


def activation_memory(shape: GPTShape) -> dict[str, Any]:
    """One process, the GPT's forward and backward on one token batch, without and with
    checkpointing: the bytes held for backward at the forward's end, and the step's seconds."""
    tokens = torch.randint(shape.vocab_size, (shape.batch_size, shape.block_size + 1), generator=_generator())
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    sides = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        options = {k: v for k, v in asdict(shape).items() if k not in ("vocab_size", "batch_size")}
        model = build_model("gpt", shape.vocab_size, shape.vocab_size, **options)
        if checkpointed:
            checkpoint_activations(model)
        counter, seconds = HeldForBackward(model), []
        for _ in range(GPT_STEPS):
            began = time.perf_counter()
            with counter.counting():
                logits = model(inputs)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            seconds.append(time.perf_counter() - began)
            model.zero_grad(set_to_none=True)
        sides["checkpointed" if checkpointed else "plain"] = {
            "saved_bytes": counter.peak_bytes,
            "step_seconds": stats(seconds[1:]),
        }
    return {
        "gpt": asdict(shape),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        **sides,
        "saved_ratio": sides["checkpointed"]["saved_bytes"] / sides["plain"]["saved_bytes"],
        "step_time_ratio": ratio(sides["checkpointed"]["step_seconds"], sides["plain"]["step_seconds"]),
    }


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)
