"""The pretrained case: a Hugging Face GPT-2 checkpoint written locally from its config (GPT-2
small's size by default; nothing downloaded) fine-tuned with ``--model hf:DIR`` by ddp and by fsdp
on 2 workers, and each worker's memory at start: its peak RSS from before the model is built to
the start of training, over the RSS it had just before (``worker_startup_rss_bytes``), against
the checkpoint's bytes. A ddp worker builds the whole model and loads every weight; an fsdp worker
builds on meta, shards, and reads only its own rows of the safetensors file. At the end, fsdp's
ranks write their slices of the weights and the driver consolidates them
(``export_peak_bytes``: the most it held at once doing so).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ray_jobs.bench.cases.common import Bench
from ray_jobs.bench.suites import GPTShape
from ray_jobs.core.config import TrainConfig
from ray_jobs.data.parquet import TOKENS_COLUMN, VOCAB_SIZE_KEY, write_table

NUM_WORKERS = 2
STRATEGIES = ("ddp", "fsdp")


def pretrained_case(bench: Bench, results: dict[str, Any]) -> dict[str, Any]:
    shape = bench.suite.pretrained
    if shape is None:
        return {}
    checkpoint = write_checkpoint(shape, os.path.join(bench.out, "data", "gpt2-checkpoint"))
    data = write_byte_rows(shape, os.path.join(bench.out, "data", "pretrained.parquet"))
    checkpoint_bytes = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
    startup: dict[str, list[int]] = {}
    export: dict[str, Any] = {}
    for strategy in STRATEGIES:
        bench.log(
            f"[bench] pretrained: {strategy} {NUM_WORKERS} workers from a "
            f"{checkpoint_bytes / 2**20:,.0f} MiB checkpoint"
        )
        extra = _fit(bench, strategy, checkpoint, data, shape).extra
        startup[strategy] = extra["worker_startup_rss_bytes"]
        if strategy == "fsdp":
            export = {key: extra.get(key) for key in ("export_bytes", "export_peak_bytes")}
    return {
        "export": export,
        "shape": vars(shape),
        "num_workers": NUM_WORKERS,
        "checkpoint_bytes": checkpoint_bytes,
        "startup_rss_bytes": startup,
        "startup_ratio": {strategy: max(startup[strategy]) / checkpoint_bytes for strategy in STRATEGIES},
    }


def write_checkpoint(shape: GPTShape, directory: str) -> str:
    """A GPT-2 of ``shape`` (no dropout), saved as ``save_pretrained`` saves one; kept between runs."""
    if not os.path.exists(os.path.join(directory, "config.json")):
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=shape.vocab_size, n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def write_byte_rows(shape: GPTShape, path: str) -> str:
    """Two global batches of byte tokens of a standard library source (ids < 257, in any GPT-2's vocabulary)."""
    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_bytes()
    stream = np.frombuffer(text, dtype=np.uint8).astype(np.int32)
    rows = [stream[i * shape.block_size : (i + 1) * shape.block_size + 1] for i in range(2 * shape.batch_size)]
    column = pa.array(rows, type=pa.list_(pa.int32()))
    write_table(pa.table({TOKENS_COLUMN: column}, metadata={VOCAB_SIZE_KEY: b"257"}), path, 1024)
    return path


def _fit(bench: Bench, strategy: str, checkpoint: str, data: str, shape: GPTShape):
    cfg = TrainConfig(
        model=f"hf:{checkpoint}", data=data, task="lm", epochs=1, batch_size=shape.batch_size, lr=1e-4,
        storage_path=bench.storage_path, name=bench.run_name(f"pretrained-{strategy}"),
    )  # fmt: skip
    return bench.fit_workers(cfg, strategy, NUM_WORKERS)
