"""Language-model data, the built-in gpt, the token loss, the model check and the throughput
formula: everything of --task lm that needs no Ray."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models import build_model, split_into_stages
from models.lm import logits_of
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.model_init import initial_model
from ray_jobs.core.step import loss_function
from ray_jobs.data.parquet import VOCAB_SIZE_KEY, read_dataset, synthesize, table_to_dataset
from ray_jobs.observability.throughput import flops_per_token, lm_throughput, peak_tflops
from tests.helpers import write_tokens


def token_table(rows: list[list[int]], vocab: int | None = None) -> pa.Table:
    metadata = {VOCAB_SIZE_KEY: str(vocab).encode()} if vocab else None
    return pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32()))}, metadata=metadata)


def test_a_row_of_t_plus_one_tokens_is_input_and_next_token_target():
    dataset = table_to_dataset(token_table([[1, 2, 3, 4], [5, 6, 7, 8]], vocab=10))
    assert dataset.task == "lm" and dataset.num_classes == 10 and dataset.block_size == 3
    assert dataset.in_features == dataset.out_features == 10  # the model is built as (V, V)
    np.testing.assert_array_equal(dataset.features, [[1, 2, 3], [5, 6, 7]])
    np.testing.assert_array_equal(dataset.targets, [[2, 3, 4], [6, 7, 8]])
    assert dataset.features.dtype == np.int64  # what nn.Embedding and cross_entropy take


@pytest.mark.parametrize(
    ("vocab_size", "metadata", "expected"),
    [(None, None, 9), (None, 50, 50), (64, 50, 64)],
    ids=["largest-id", "metadata", "flag"],
)
def test_the_vocabulary_comes_from_the_flag_the_metadata_or_the_ids(vocab_size, metadata, expected):
    dataset = table_to_dataset(token_table([[1, 8, 3], [0, 2, 5]], vocab=metadata), num_classes=vocab_size)
    assert dataset.num_classes == expected


@pytest.mark.parametrize(
    ("table", "task", "message"),
    [
        (token_table([[1, 2, 3], [4, 12, 5]], vocab=10), "auto", "row 1 has token id 12, outside the vocabulary 0..9"),
        (token_table([[1, 2, 3], [4, 5]]), "auto", "row 0 has 3 tokens, row 1 has 2"),
        (token_table([[1], [2]]), "auto", "rows of 1 token(s); a row needs T+1 >= 2"),
        (token_table([[1, -2, 3]]), "auto", "token id -2, outside the vocabulary"),
        (synthesize(8, 3, 2), "lm", "--task lm needs a list<int> column of token ids (the data has no column 'tokens'"),
    ],
    ids=["id-too-large", "unequal-rows", "one-token", "negative", "not-tokens"],
)
def test_bad_token_data_is_one_line_naming_the_row(table, task, message):
    with pytest.raises(ValueError, match=None) as error:
        table_to_dataset(table, task=task)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_auto_keeps_feature_data_what_it_was():
    assert table_to_dataset(synthesize(8, 3, 2, "classification")).task == "classification"


def test_vocab_size_is_refused_for_other_tasks():
    with pytest.raises(ValueError, match="--vocab-size applies to --task lm, not --task regression"):
        TrainConfig(task="regression", vocab_size=100)


def test_the_gpt_is_causal_and_its_stages_compute_it_exactly():
    torch.manual_seed(0)
    model = build_model("gpt", 30, 30, n_layer=3, n_head=2, n_embd=16, block_size=8)
    tokens = torch.randint(0, 30, (2, 8))
    logits = model(tokens)
    assert logits.shape == (2, 8, 30)
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 30
    # A later token never reaches an earlier position's logits.
    torch.testing.assert_close(model(changed)[:, :5], logits[:, :5], rtol=0, atol=0)
    x = tokens
    for stage in split_into_stages(model, 3):
        x = stage(x)
    torch.testing.assert_close(x, logits, rtol=0, atol=0)  # the same ops on the same inputs
    assert [name for name, _ in model.named_children()] == ["embed", "block_0", "block_1", "block_2", "head"]


def test_the_token_loss_is_the_mean_over_every_token_whatever_the_model_returns():
    logits, target = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    expected = F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1))
    loss = loss_function("lm")

    class Output:  # a Hugging Face model's output object
        def __init__(self, logits):
            self.logits = logits

    for output in (logits, (logits, None), Output(logits)):
        torch.testing.assert_close(loss(output, target), expected, rtol=0, atol=0)
    with pytest.raises(TypeError, match="a language model must return logits"):
        logits_of({"scores": logits})


def lm_cfg(path: str, **changes) -> TrainConfig:
    return TrainConfig(**{"data": path, "model": "gpt", "model_option": ["n_layer=1", "n_embd=8"], **changes})


def test_a_gpt_shorter_than_the_data_is_refused_before_ray(tmp_path):
    path = write_tokens(str(tmp_path / "tokens.parquet"), rows=4, block_size=8)
    cfg = lm_cfg(path, model_option=["n_layer=1", "n_embd=8", "block_size=4"])
    with pytest.raises(
        ValueError, match="longer than the model's block_size 4; build it with --model-option block_size=8"
    ):
        initial_model(cfg, read_dataset(path))


def test_a_model_returning_the_wrong_shape_is_refused_with_the_shape_it_returned(tmp_path, monkeypatch):
    path = write_tokens(str(tmp_path / "tokens.parquet"), rows=4, block_size=8)
    (tmp_path / "flat_lm.py").write_text(
        "from torch import nn\n"
        "class Flat(nn.Module):\n"
        "    def __init__(self, v):\n"
        "        super().__init__()\n"
        "        self.embed = nn.Embedding(v, v)\n"
        "    def forward(self, tokens):\n"
        "        return self.embed(tokens).mean(dim=1)\n"  # (B, V): no position axis
        "def build(i, o):\n"
        "    return Flat(i)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"returned logits of shape \(2, 257\) for a \(2, 8\) batch"):
        initial_model(TrainConfig(data=path, model="flat_lm:build"), read_dataset(path))


def test_the_model_check_draws_nothing_from_the_runs_rng(tmp_path):
    path = write_tokens(str(tmp_path / "tokens.parquet"), rows=4, block_size=8)
    dataset = read_dataset(path)
    cfg = lm_cfg(path, model_option=["n_layer=1", "n_embd=8", "dropout=0.5"])
    initial_model(cfg, dataset)
    after = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    build_model("gpt", 257, 257, n_layer=1, n_embd=8, dropout=0.5, block_size=8)
    assert torch.equal(after, torch.random.get_rng_state())


def test_flops_per_token_is_six_n_without_lookups_plus_the_attention_term():
    with torch.device("meta"):
        model = build_model("gpt", 100, 100, n_layer=2, n_head=2, n_embd=16, block_size=8)
    matmuls = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed."))
    record = {"n_layer": 2, "n_embd": 16}
    assert flops_per_token(model, record, 8) == 6 * matmuls + 12 * 2 * 16 * 8

    class Tied(nn.Module):  # GPT-2's head shares the token table: a matmul, so counted
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.wte.weight

    assert flops_per_token(Tied(), {}, 8) == 6 * 40


def test_peak_flops_by_device_name_and_mfu():
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A10G", "bf16") == 70.0  # not the A100's figure
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 494.5
    assert peak_tflops("Some Future GPU", "bf16") is None
    assert peak_tflops(None, "bf16", stated=100.0) == 100.0
    readings = lm_throughput(10.0, 64, 2, flops=1e9, peak=1.0)
    assert readings == {"tokens_per_second": 640.0, "tokens_per_second_per_worker": 320.0, "mfu": 640 * 1e9 / 2e12}
    assert lm_throughput(10.0, 64, 2)["mfu"] is None
    assert lm_throughput(10.0, None, 2) == {}


def test_token_data_reads_whole_or_streamed_the_same(tmp_path):
    from ray_jobs.data.stream_plan import decode_block, plan_stream

    path = write_tokens(str(tmp_path / "tokens.parquet"), rows=10, block_size=6, row_group_rows=4)
    whole = read_dataset(path)
    plan = plan_stream(path, "features", "target", "auto", None, 8)
    assert (plan.task, plan.block_size, plan.num_classes, plan.num_rows) == ("lm", 6, 257, 10)
    parts = [
        decode_block(plan.filesystem, block, "features", "target", plan.task, plan.num_classes) for block in plan.blocks
    ]
    np.testing.assert_array_equal(np.concatenate([part.features for part in parts]), whole.features)
    np.testing.assert_array_equal(np.concatenate([part.targets for part in parts]), whole.targets)


def test_a_feature_model_on_token_data_is_refused_naming_the_models_that_fit(tmp_path):
    path = write_tokens(str(tmp_path / "tokens.parquet"), rows=4, block_size=8)
    with pytest.raises(ValueError, match="--model seed-mlp takes float features; the data is token ids"):
        initial_model(TrainConfig(data=path), read_dataset(path))
