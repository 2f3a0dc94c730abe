"""What the bench's suites and cases run (no Ray)."""

from __future__ import annotations

from ray_jobs.bench.cases.accumulation import ACCUM_STEPS, step_saved_bytes
from ray_jobs.bench.cases.data_parallel import worker_counts
from ray_jobs.bench.cases.pipeline import same_ops_as
from ray_jobs.bench.suites import SUITES


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
