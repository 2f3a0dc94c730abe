"""The tokenize case: encoding tokens/s of ``tokenize`` in one process against ``tokenize --ray``
on 1 and on 2 of the cluster's CPUs, byte and bpe, on the standard library's sources (real text
on every machine), with the rows checked identical.

The cluster is the bench's own; "1 CPU" holds all its other CPUs in an idle actor for the run, so
Ray Data's tasks find one free. The driver (this process: routing the ids, writing the rows) and
Ray's own processes run beside the tasks on the same cores, and the one-process command's bpe
library encodes a batch on every core: on a 2-core machine these ratios understate what more
nodes give. Each encoding rate leaves out the bpe training, which is the same in both paths.
"""

from __future__ import annotations

import io
import os
import sysconfig
from contextlib import contextmanager
from typing import Any

import numpy as np

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.stats import ratio, stats

KINDS = ("byte", "bpe")
BPE_VOCAB = 1024
BLOCK_SIZE = 256
TOKENIZE_FILE_BYTES = 1_000_000  # a corpus shard: few tasks, each long beside its scheduling
SIDES = ("single", "ray_1", "ray_2")


def tokenize_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    import ray

    corpus = os.path.join(bench.out, "data", "tokenize-corpus")
    corpus_bytes = write_corpus(corpus, bench.suite.tokenize_bytes)
    rates: dict[str, dict[str, list[float]]] = {kind: {side: [] for side in SIDES} for kind in KINDS}
    identical = True
    total_cpus = int(ray.cluster_resources().get("CPU", 0))
    for rep in range(bench.suite.cheap_repetitions):
        for kind in KINDS:
            bench.log(f"[bench] tokenize {kind} (repetition {rep + 1})")
            outputs = {}
            for side in SIDES:
                out = os.path.join(bench.out, "tokenized", side)
                cpus = None if side == "single" else int(side[-1])
                rates[kind][side].append(_encode_rate(corpus, out, kind, cpus, total_cpus))
                outputs[side] = out
            identical &= _same_rows(outputs)
    figures = {kind: {side: stats(values) for side, values in sides.items()} for kind, sides in rates.items()}
    return {
        "corpus_bytes": corpus_bytes,
        "block_size": BLOCK_SIZE,
        "bpe_vocab": BPE_VOCAB,
        "cluster_cpus": total_cpus,
        "tokens_per_second": figures,
        "ray_2_over_ray_1": {kind: ratio(figures[kind]["ray_2"], figures[kind]["ray_1"]) for kind in KINDS},
        "ray_2_over_single": {kind: ratio(figures[kind]["ray_2"], figures[kind]["single"]) for kind in KINDS},
        "identical_rows": identical,
    }


def write_corpus(directory: str, limit: int) -> int:
    """The standard library's sources (tests and site-packages left out), in name order, in files
    of about ``TOKENIZE_FILE_BYTES``, up to ``limit`` bytes; returns the bytes written."""
    stdlib = sysconfig.get_paths()["stdlib"]
    os.makedirs(directory, exist_ok=True)
    written, part, parts = 0, [], 0
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "site-packages", "__pycache__"))
        for name in sorted(n for n in names if n.endswith(".py")):
            with open(os.path.join(root, name), "rb") as source:
                part.append(source.read())
            if sum(map(len, part)) >= TOKENIZE_FILE_BYTES or written + sum(map(len, part)) >= limit:
                written, part, parts = written + _write_part(directory, parts, part), [], parts + 1
            if written >= limit:
                return written
    return written + (_write_part(directory, parts, part) if part else 0)


def _write_part(directory: str, index: int, part: list[bytes]) -> int:
    with open(os.path.join(directory, f"part-{index:04d}.txt"), "wb") as out:
        out.write(b"".join(part))
    return sum(map(len, part))


def _encode_rate(corpus: str, out: str, kind: str, cpus: int | None, total_cpus: int) -> float:
    """Tokens/s of the encoding (the bpe training left out): in this process, or on ``cpus``."""
    from ray_jobs.data import tokenize_ray, tokenized

    options = {"kind": kind, "vocab_size": BPE_VOCAB if kind == "bpe" else None, "progress_out": io.StringIO()}
    if cpus is None:
        report = tokenized.tokenize([corpus], out, BLOCK_SIZE, **options)
    else:
        with _holding(total_cpus - cpus):
            report = tokenize_ray.tokenize([corpus], out, BLOCK_SIZE, **options)
    return report.tokens / max(report.seconds - report.train_seconds, 1e-9)


@contextmanager
def _holding(cpus: int):
    """``cpus`` of the cluster held by an idle actor, so the tasks find only the rest free."""
    import ray

    if cpus <= 0:
        yield
        return
    holder = ray.remote(num_cpus=cpus)(_Idle).remote()
    ray.get(holder.ready.remote())
    try:
        yield
    finally:
        ray.kill(holder)


class _Idle:
    def ready(self) -> bool:
        return True


def _same_rows(outputs: dict[str, str]) -> bool:
    from ray_jobs.data.parquet import read_dataset

    expected = read_dataset(os.path.join(outputs["single"], "train.parquet")).features
    return all(
        np.array_equal(read_dataset(os.path.join(outputs[side], "train")).features, expected)
        for side in SIDES
        if side != "single"
    )
