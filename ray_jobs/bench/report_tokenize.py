"""bench.md's section for the tokenize case: one process against Ray Data tasks on 1 and 2 CPUs."""

from __future__ import annotations

from typing import Any

from ray_jobs.bench.report_tables import fmt, markdown_table

SIDE_NAMES = {"single": "one process", "ray_1": "--ray, 1 CPU", "ray_2": "--ray, 2 CPUs"}


def tokenize_section(case: dict[str, Any] | None) -> list[str]:
    if not case:
        return []
    rows = [
        [kind, *(fmt(case["tokens_per_second"][kind][side], ",.0f", 1e-3) for side in SIDE_NAMES)]
        + [fmt(case["ray_2_over_ray_1"][kind], ".2f"), fmt(case["ray_2_over_single"][kind], ".2f")]
        for kind in case["tokens_per_second"]
    ]
    same = "identical to the one process's" if case["identical_rows"] else "NOT identical to the one process's"
    return [
        "",
        "## Tokenizing: one process against Ray Data tasks",
        "",
        f"{case['corpus_bytes'] / 1e6:.1f} MB of the standard library's sources, block size {case['block_size']}, "
        f"bpe vocabulary {case['bpe_vocab']}; encoding thousands of tokens/s (bpe training left out). The driver "
        f"and Ray's own processes share the cores with the tasks ({case['cluster_cpus']} CPUs in the cluster); "
        f"the rows of every --ray run were {same}.",
        "",
        markdown_table(["tokenizer", *SIDE_NAMES.values(), "2 CPUs / 1", "2 CPUs / one process"], rows),
    ]
