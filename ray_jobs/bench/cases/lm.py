"""The language-model case: the built-in gpt on byte tokens of the standard library's sources, in
tokens/s. Raypar DDP against the plain torch.distributed peer (``peer.torch_ddp``: the same gpt,
initial weights, tokens, global batch and token cross-entropy), and the actor pipeline (GPipe and
1F1B) against its sequential schedule (one micro-batch at a time through the same stage actors)
and against the whole gpt in one process (the peer with one process and one thread), their runs
interleaved; and raypar DDP with ``--compile`` against itself eager: steady tokens/s, and the
compiling's seconds apart.

Tokens/s is samples/s times T: every row holds T input positions, each one predicted."""

from __future__ import annotations

import os
import sysconfig
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.cases.data_parallel import max_workers, raypar_data_parallel
from ray_jobs.bench.cases.pipeline import THREADS_PER_STAGE, run_pipeline
from ray_jobs.bench.stats import ratio, stats, summarise
from ray_jobs.bench.suites import PIPELINE_TRANSPORT, LmWorkload
from ray_jobs.data.parquet import TOKENS_COLUMN, VOCAB_SIZE_KEY, write_table

LM_SCHEDULES = ("sequential", "gpipe", "1f1b")  # the baseline first
END_OF_TEXT = 256  # the byte tokenizer's token after the 256 byte values, between documents


def stdlib_byte_tokens(count: int) -> np.ndarray:
    """``count`` byte tokens of the standard library's ``.py`` sources in name order, each file's
    bytes followed by ``END_OF_TEXT``, as the byte tokenizer reads a folder of text: real text, the
    same on every machine with the same Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)
        parts += [text, np.array([END_OF_TEXT], dtype=np.int32)]
        total += len(text) + 1
        if total >= count:
            return np.concatenate(parts)[:count]
    raise ValueError(f"the standard library's sources in {stdlib} hold {total:,} bytes, fewer than {count:,} tokens")


def write_lm_tokens(path: str, rows: int, block_size: int, vocab_size: int = END_OF_TEXT + 1) -> str:
    """The case's data: ``rows`` rows of ``block_size + 1`` consecutive tokens (a row's last token
    is the next row's first, as ``tokenize`` writes them), ``raypar.vocab_size`` stated."""
    stream = stdlib_byte_tokens(rows * block_size + 1)
    tokens = [stream[i * block_size : (i + 1) * block_size + 1] for i in range(rows)]
    table = pa.table(
        {TOKENS_COLUMN: pa.array(tokens, type=pa.list_(pa.int32()))},
        metadata={VOCAB_SIZE_KEY: str(vocab_size).encode()},
    )
    write_table(table, path)
    return path


def per_token(figure: dict[str, Any], block_size: int) -> dict[str, Any]:
    """A samples/s figure (median, min, max, values) as tokens/s: ``block_size`` tokens a row."""
    return {
        key: ([v * block_size for v in value] if isinstance(value, list) else value * block_size)
        for key, value in figure.items()
    }


def lm_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    suite, work = bench.suite, bench.suite.lm
    data = write_lm_tokens(os.path.join(bench.out, "data", "lm.parquet"), work.rows, work.block_size, work.vocab_size)
    num_workers = min(suite.ddp_workers, max_workers())
    while num_workers > 1 and work.batch_size % num_workers:
        num_workers -= 1
    m = suite.target_microbatches
    sides = ("raypar", "torch", "raypar_compiled", "single_process", *LM_SCHEDULES)
    raw: dict[str, list[dict]] = {side: [] for side in sides}
    for rep in range(max(suite.lm_ddp_pairs, suite.lm_repetitions)):
        if rep < suite.lm_ddp_pairs:  # the pair the goal is judged on gets more repetitions
            bench.measure(
                raw["raypar"],
                f"lm: raypar DDP {num_workers} workers",
                rep,
                lambda: raypar_data_parallel(bench, "ddp", num_workers, work=work, data=data),
            )
            bench.measure(
                raw["torch"],
                f"lm: torch DDP {num_workers} processes",
                rep,
                lambda: bench.peer(work, data, num_workers, 1),
            )
        if rep >= suite.lm_repetitions:
            continue
        if suite.lm_compile:
            bench.measure(
                raw["raypar_compiled"],
                f"lm: raypar DDP {num_workers} workers, --compile",
                rep,
                lambda: raypar_data_parallel(bench, "ddp", num_workers, work=work, data=data, compile=True),
            )
        bench.measure(
            raw["single_process"],
            "lm: single process, whole gpt",
            rep,
            lambda: bench.peer(work, data, 1, THREADS_PER_STAGE),
        )
        for schedule in LM_SCHEDULES:
            bench.measure(
                raw[schedule],
                f"lm: pipeline S={suite.num_stages} M={m} {schedule}",
                rep,
                lambda schedule=schedule: run_pipeline(bench, schedule, m, PIPELINE_TRANSPORT, work=work, data=data),
            )
    os.remove(data)
    return lm_figures(raw, work, num_workers, suite.num_stages, m)


def lm_figures(
    raw: dict[str, list[dict]], work: LmWorkload, num_workers: int, num_stages: int, num_microbatches: int
) -> dict[str, Any]:
    """The case's section of ``bench.json`` from its runs: every samples/s also as tokens/s, and the ratios."""
    tokens = {
        side: per_token(summarise(runs)["samples_per_second"], work.block_size) for side, runs in raw.items() if runs
    }
    pipeline = {side: summarise(raw[side]) for side in LM_SCHEDULES}
    return {
        "workload": asdict(work),
        "tokens_per_step": work.batch_size * work.block_size,
        "ddp": {
            "num_workers": num_workers,
            "raypar_tokens_per_second": tokens["raypar"],
            "torch_tokens_per_second": tokens["torch"],
            "tokens_per_second_ratio": ratio(tokens["raypar"], tokens["torch"]),
            "raypar_peak_rss_bytes": summarise(raw["raypar"])["peak_rss_bytes"],
            "torch_peak_rss_bytes": summarise(raw["torch"])["peak_rss_bytes"],
        },
        "compile": (
            compile_figures(raw["raypar_compiled"], raw["raypar"], work.block_size)
            if raw.get("raypar_compiled")
            else None
        ),
        "pipeline": {
            "num_stages": num_stages,
            "num_microbatches": num_microbatches,
            "threads_per_stage": THREADS_PER_STAGE,
            "single_process_tokens_per_second": tokens["single_process"],
            "schedules": [
                {
                    "schedule": schedule,
                    "tokens_per_second": tokens[schedule],
                    "bubble_fraction": pipeline[schedule]["bubble_fraction"],
                    "speedup_vs_sequential": ratio(tokens[schedule], tokens["sequential"]),
                    "speedup_vs_single_process": ratio(tokens[schedule], tokens["single_process"]),
                }
                for schedule in LM_SCHEDULES
            ],
        },
        "raw": raw,
    }


def compile_figures(compiled: list[dict], eager: list[dict], block_size: int) -> dict[str, Any]:
    """``--compile`` beside eager, each a list of runs: steady tokens/s, and the seconds the
    compiling took, the first epoch's excess over a steady one less eager's excess (its warm-up)."""
    compiled_tokens = per_token(summarise(compiled)["samples_per_second"], block_size)
    eager_tokens = per_token(summarise(eager)["samples_per_second"], block_size)
    excess = [
        run["first_epoch_excess_s"] - peer["first_epoch_excess_s"]
        for run, peer in zip(compiled, eager)
        if run["first_epoch_excess_s"] is not None and peer["first_epoch_excess_s"] is not None
    ]
    return {
        "compiled_tokens_per_second": compiled_tokens,
        "eager_tokens_per_second": eager_tokens,
        "tokens_per_second_ratio": ratio(compiled_tokens, eager_tokens),
        "compile_seconds": stats(excess) if excess else None,
    }
