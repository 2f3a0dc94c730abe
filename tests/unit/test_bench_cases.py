"""What the bench's suites and cases run (no Ray)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from ray_jobs.bench.cases.accumulation import ACCUM_STEPS, step_saved_bytes
from ray_jobs.bench.cases.data_parallel import worker_counts
from ray_jobs.bench.cases.lm import lm_figures, per_token, stdlib_byte_tokens, write_lm_tokens
from ray_jobs.bench.cases.pipeline import same_ops_as
from ray_jobs.bench.stats import stats
from ray_jobs.bench.suites import SUITES
from ray_jobs.data.parquet import read_dataset


def test_schedules_with_the_same_op_order_run_once():
    assert {same_ops_as(s, 2, 1) for s in ("gpipe", "1f1b", "sequential")} == {"sequential"}  # F0 B0 everywhere
    assert [same_ops_as(s, 2, 8) for s in ("gpipe", "1f1b", "sequential")] == ["gpipe", "1f1b", "sequential"]
    assert same_ops_as("1f1b", 1, 4) == "sequential"  # one stage: 1F1B alternates from the start


def test_worker_counts_are_powers_of_two_up_to_the_cluster_and_divide_the_batch():
    assert worker_counts(2, 128) == [1, 2]
    assert worker_counts(6, 128) == [1, 2, 4]  # 6 does not divide 128
    assert worker_counts(6, 96) == [1, 2, 4, 6]
    assert worker_counts(1, 7) == [1]


def test_suites_keep_the_global_batch_divisible():
    for suite in SUITES.values():
        assert suite.ddp.batch_size % suite.ddp_workers == 0, suite.name
        assert all(suite.pipeline.batch_size % m == 0 for m in suite.microbatches), suite.name
        assert suite.target_microbatches in suite.microbatches, suite.name
        assert suite.accum.batch_size % (suite.ddp_workers * max(ACCUM_STEPS)) == 0, suite.name


def test_the_accumulation_case_holds_a_quarter_of_the_activations_at_k4():
    work = SUITES["quick"].accum  # 8,192 rows per worker: 64 in, 1,024 x 3 hidden (ReLU outputs), 16 out
    per_row = (64 + 3 * 1024 + 16 + 16) * 4  # each Linear's input, the loss's input and target, float32
    assert [step_saved_bytes(work, 2, k) for k in (1, 4)] == [8192 * per_row, 2048 * per_row]


def test_the_lm_batch_divides_over_the_workers_and_the_microbatches():
    for suite in SUITES.values():
        assert suite.lm.batch_size % suite.ddp_workers == 0, suite.name
        assert suite.lm.batch_size % suite.target_microbatches == 0, suite.name
        assert suite.lm.n_embd % suite.lm.n_head == 0, suite.name


def test_the_lm_tokens_are_consecutive_bytes_of_the_standard_library(tmp_path):
    path = write_lm_tokens(str(tmp_path / "lm.parquet"), rows=5, block_size=8)
    dataset = read_dataset(path, task="auto")
    assert (dataset.task, dataset.num_classes, dataset.block_size, dataset.num_rows) == ("lm", 257, 8, 5)
    stream = stdlib_byte_tokens(5 * 8 + 1)
    torch.testing.assert_close(torch.from_numpy(dataset.features), torch.from_numpy(stream[:40]).long().view(5, 8))
    torch.testing.assert_close(torch.from_numpy(dataset.targets), torch.from_numpy(stream[1:41]).long().view(5, 8))
    first = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[0].read_bytes()
    shown = min(len(first), 41)
    assert bytes(stream[:shown].tolist()) == first[:shown]  # the first source's bytes, as they are


def test_lm_figures_are_tokens_per_second_and_their_ratios():
    work = SUITES["smoke"].lm  # T = 16
    pipe = {"bubble_fraction": [0.5]}
    raw = {
        "raypar": [{"samples_per_second": [90.0, 100.0], "peak_rss_bytes": 5}],
        "torch": [{"samples_per_second": [100.0], "peak_rss_bytes": 4}],
        "single_process": [{"samples_per_second": [50.0]}],
        "sequential": [{"samples_per_second": [40.0], **pipe}],
        "gpipe": [{"samples_per_second": [70.0], **pipe}],
        "1f1b": [{"samples_per_second": [60.0], **pipe}],
    }
    figures = lm_figures(raw, work, num_workers=2, num_stages=2, num_microbatches=4)
    ddp = figures["ddp"]
    assert ddp["raypar_tokens_per_second"] == stats([90.0 * 16, 100.0 * 16])
    assert ddp["tokens_per_second_ratio"] == {"median": 0.95, "min": 0.9, "max": 1.0}
    assert figures["tokens_per_step"] == work.batch_size * 16
    gpipe = figures["pipeline"]["schedules"][1]
    assert gpipe["schedule"] == "gpipe" and gpipe["tokens_per_second"]["median"] == 70.0 * 16
    assert gpipe["speedup_vs_sequential"]["median"] == 70.0 / 40.0
    assert gpipe["speedup_vs_single_process"]["median"] == 70.0 / 50.0
    assert per_token(stats([2.0, 3.0]), 4) == stats([8.0, 12.0])


def test_the_communication_model_counts_ring_bytes_by_where_each_link_runs():
    from ray_jobs.bench.cases.comm_model import MODELS, comm_model_case, layouts
    from ray_jobs.bench.report_comm_model import comm_model_section

    small, large = MODELS
    rows = {row["layout"].split(" (")[0]: row for row in layouts(large)}
    grads = large.parameters * 4
    # DDP: a ring all-reduce of the fp32 gradients over 16 ranks crosses between the 2 nodes on 2 edges.
    assert rows["DDP"]["inter_bytes"] == pytest.approx(2 * 2 * 15 / 16 * grads)
    assert rows["DDP"]["intra_bytes"] + rows["DDP"]["inter_bytes"] == pytest.approx(16 * 2 * 15 / 16 * grads)
    # fsdp: two bf16 all-gathers and one fp32 reduce-scatter move what DDP's all-reduce moves.
    assert rows["fsdp"]["intra_bytes"] + rows["fsdp"]["inter_bytes"] == pytest.approx(
        rows["DDP"]["intra_bytes"] + rows["DDP"]["inter_bytes"]
    )
    # HSDP: only each shard's all-reduce across the two nodes leaves a node: 8 pairs, each rank sending its shard.
    assert rows["HSDP"]["inter_bytes"] == pytest.approx(8 * 2 * grads / 8)
    # Data innermost: a stage's copies reduce on their node; only the activations cross.
    assert rows["DP x PP"]["inter_bytes"] == rows["FSDP x PP"]["inter_bytes"] == rows["PP"]["inter_bytes"]
    assert rows["DP x PP"]["bubble"] == pytest.approx(1 / 9) and rows["DDP"]["bubble"] == 0
    assert {row["layout"].split(" (")[0]: row for row in layouts(small)}["PP"]["inter_bytes"] is None  # 12 layers
    section = "\n".join(comm_model_section(comm_model_case()))
    assert "GPT-2 1.5B" in section and "| DDP (16 replicas)" in section


def test_the_bytes_handed_per_step_follow_each_layouts_calls():
    from ray_jobs.bench.cases.comm_model import Params, handed
    from ray_jobs.bench.cases.layouts import comm_agreement

    # Two block weights of 5 rows (padded to 6 over 2 shards), a kept (root or last unit's) embedding of 4 rows.
    params = Params(resharded=((5, 10), (5, 5)), kept=((4, 8),))
    assert params.count == 23 and params.padded(2) == 12 + 6 + 8 and params.padded(2, "resharded") == 18
    ddp = handed("ddp", params, 4, batch_rows=8, row_activation=3)
    assert ddp["all_reduce"] == 4 * 23 * 4 and not ddp["send"] and not ddp["all_gather"]
    hsdp = handed("hsdp", params, 4, 8, 3)
    assert hsdp["all_gather"] == 4 * (2 * 18 + 8) * 4  # resharded groups gathered twice, kept ones once
    assert hsdp["reduce_scatter"] == 4 * 26 * 4 and hsdp["all_reduce"] == 4 * 13 * 4
    pipe = handed("pipeline", params, 4, 8, 3)  # 3 cuts, 8 rows of 3 each way
    assert pipe["send"] == pipe["recv"] == 2 * 3 * 8 * 3 * 4 and not pipe["all_reduce"]
    grid = handed("dp_x_pp", params, 4, 8, 3)  # 1 cut, both replicas' rows
    assert grid["send"] == 2 * 1 * 8 * 3 * 4 and grid["all_reduce"] == 2 * 24 * 4  # with the loss
    sharded = handed("fsdp_x_pp", params, 4, 8, 3)
    assert sharded["all_gather"] == sharded["reduce_scatter"] == 2 * 26 * 4 and sharded["all_reduce"] == 2 * 4

    comm = {"ddp": {"model": ddp, "measured": {**ddp, "all_reduce": ddp["all_reduce"] * 1.005}}}
    assert comm_agreement(comm) == pytest.approx(0.005)
    comm["pipeline"] = {"model": pipe, "measured": {**pipe, "broadcast": 4.0}}  # a call the model has not
    assert comm_agreement(comm) == 1.0


def test_the_tokenize_corpus_is_real_text_cut_into_files_up_to_its_size(tmp_path):
    from ray_jobs.bench.cases.tokenize import TOKENIZE_FILE_BYTES, write_corpus
    from ray_jobs.bench.report_tokenize import tokenize_section

    written = write_corpus(str(tmp_path), 2 * TOKENIZE_FILE_BYTES + 10)
    files = sorted(tmp_path.iterdir())
    assert [path.name for path in files[:2]] == ["part-0000.txt", "part-0001.txt"] and len(files) <= 3
    assert all(path.stat().st_size >= TOKENIZE_FILE_BYTES for path in files[:-1])
    assert written == sum(path.stat().st_size for path in files) >= 2 * TOKENIZE_FILE_BYTES + 10
    assert "def " in files[0].read_text()

    def figure(value: float) -> dict:
        return {"median": value, "min": value, "max": value}

    case = {
        "corpus_bytes": written,
        "block_size": 256,
        "bpe_vocab": 1024,
        "cluster_cpus": 2,
        "tokens_per_second": {"bpe": {"single": figure(2e6), "ray_1": figure(1e6), "ray_2": figure(1.5e6)}},
        "ray_2_over_ray_1": {"bpe": figure(1.5)},
        "ray_2_over_single": {"bpe": figure(0.75)},
        "identical_rows": True,
    }
    text = "\n".join(tokenize_section(case))
    assert "| bpe       |       2,000 |        1,000 |         1,500 |       1.50 |" in text and "identical to" in text
