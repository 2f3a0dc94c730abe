"""Language models: every strategy trains the built-in gpt, and a user's LM that returns its logits
as Hugging Face models do, to the weights of plain single-process torch on the same tokens
(``F.cross_entropy`` over every token of each global batch); validation gives perplexity.

SGD, not AdamW: AdamW turns the float-order noise of an all-reduce into visible differences on a
transformer's parameters whose true gradient is ~0 (the brief measured 2.6e-4 after 80 steps)."""

from __future__ import annotations

import json
import math
import textwrap
import uuid

import pytest

from ray_jobs.pipeline.scaling import PipelineScaling
from tests.helpers import (
    assert_same_weights,
    assert_trains_the_reference,
    lm_config,
    load_weights,
    reference_for,
    run_strategy,
    write_tokens,
)

pytestmark = pytest.mark.ray


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        ("ddp", {"num_workers": 2, "accum": 2}),  # 1 worker: the validation test below
        ("dp", {}),
        ("pipeline", {"scaling": PipelineScaling(num_stages=2, num_microbatches=2, schedule="gpipe")}),
        ("pipeline", {"scaling": PipelineScaling(num_stages=2, num_microbatches=4, schedule="1f1b")}),
    ],
    ids=["ddp-2-accum", "dp", "pipeline-gpipe", "pipeline-1f1b"],
)
def test_every_strategy_trains_the_gpt_of_one_process(ray_cluster, tokens, tmp_path, strategy, options):
    cfg = lm_config(tokens, tmp_path, grad_accum_steps=options.pop("accum", 1))
    summary = run_strategy(strategy, cfg, **options)
    # Tolerance (assert_same_weights): gloo's all-reduce and the micro-batches sum in another order, float32.
    assert_trains_the_reference(summary, cfg)
    assert summary.task == "lm" and summary.block_size == 8
    assert summary.tokens_per_second == pytest.approx(summary.samples_per_second * 8)


USER_LM = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Output:  # what a Hugging Face causal LM returns: an object with .logits
        def __init__(self, logits):
            self.logits = logits


    class TinyLM(nn.Module):
        def __init__(self, vocab_size, width):
            super().__init__()
            self.embed = nn.Embedding(vocab_size, width)
            self.mix = nn.Linear(2 * width, width)
            self.head = nn.Linear(width, vocab_size)

        def forward(self, tokens):
            x = self.embed(tokens)
            previous = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
            return Output(self.head(torch.tanh(self.mix(torch.cat([x, previous], dim=-1)))))


    def build(in_features, out_features, width=12):
        assert in_features == out_features  # V in, V out
        return TinyLM(in_features, width)
    """
)


def test_a_users_lm_returning_logits_as_hugging_face_does_trains_with_ddp(ray_cluster, tokens, tmp_path, monkeypatch):
    module = f"user_lm_{uuid.uuid4().hex[:12]}"  # its own name: no other test's import is cached
    (tmp_path / f"{module}.py").write_text(USER_LM)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = lm_config(tokens, tmp_path, model=f"{module}:build", model_option=["width=12"])
    summary = run_strategy("ddp", cfg, num_workers=2)
    expected, _ = reference_for(cfg)
    # Tolerance (assert_same_weights): gloo's all-reduce order, float32.
    assert_same_weights(load_weights(summary.run_dir), expected)


def test_validation_reports_perplexity_and_the_run_keeps_the_tokenizer(ray_cluster, tmp_path):
    """One ddp worker streams the gpt's tokens to the single process's weights; validation gives
    perplexity, and the run keeps the data's tokenizer."""
    import pyarrow.parquet as pq

    from ray_jobs.data.parquet import TOKENIZER_KEY

    train = write_tokens(str(tmp_path / "train.parquet"), rows=32, block_size=8)
    val = write_tokens(str(tmp_path / "val.parquet"), rows=8, block_size=8)
    spec = json.dumps({"kind": "byte", "vocab_size": 257, "eot_id": 256})
    for path in (train, val):  # as tokenize writes it: the tokenizer in the files' metadata
        table = pq.read_table(path)
        pq.write_table(table.replace_schema_metadata({**table.schema.metadata, TOKENIZER_KEY: spec.encode()}), path)
    cfg = lm_config(train, tmp_path, val_data=val, epochs=2, ingest="stream", shuffle_window_rows=16)
    summary = run_strategy("ddp", cfg, num_workers=1)
    assert_trains_the_reference(summary, cfg)  # float32 sums of the same batches in another order
    assert summary.val_perplexity == pytest.approx([math.exp(loss) for loss in summary.val_losses])
    assert summary.val_perplexity[-1] < 257  # better than a uniform guess over the bytes
    assert json.loads((tmp_path / "run" / "tokenizer.json").read_text()) == json.loads(spec)
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["model"]["block_size"] == 8 and written["task"] == "lm"
