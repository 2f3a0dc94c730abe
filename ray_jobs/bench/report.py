"""The bench's report, ``bench.md``: one Markdown table per case, then the targets."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ray_jobs.bench.cases.pipeline import TIME_SHARES
from ray_jobs.bench.stats import QUIET_STEAL, gpipe_bubble
from ray_jobs.bench.suites import OTHER_TRANSPORTS, PIPELINE_TRANSPORT

MIB = 1024 * 1024


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)} has {len(row)} cells, the table has {len(headers)} columns")
    # a column is numeric when every cell is a number or "-" (not measured), and one is a number
    numeric = [
        all(_looks_numeric(row[i]) or str(row[i]) == "-" for row in rows)
        and any(_looks_numeric(row[i]) for row in rows)
        for i in range(len(headers))
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _looks_numeric(value: Any) -> bool:
    text = str(value).strip()
    return bool(text) and text != "-" and (text[0].isdigit() or text[0] in "-+.")


def fmt(figure: dict[str, Any] | None, spec: str = ",.0f", scale: float = 1.0) -> str:
    """``median (min–max)``, or ``-`` for a figure that was not measured."""
    if figure is None:
        return "-"
    median, low, high = (scale * figure[k] for k in ("median", "min", "max"))
    if f"{low:{spec}}" == f"{high:{spec}}":
        return f"{median:{spec}}"
    return f"{median:{spec}} ({low:{spec}}–{high:{spec}})"


def render(results: dict[str, Any]) -> str:
    """The Markdown report: one table per case, then the targets."""
    machine = results["machine"]
    parts = [
        f"# raypar bench: suite `{results['suite']}`",
        "",
        f"{machine['cpu_count']} CPUs, {_gpus(machine)}torch {machine['torch']}, ray {machine['ray']}, "
        f"python {machine['python']}, "
        f"{machine['platform']}; {results['seconds']:.0f} s; load average (1/5/15 min) "
        f"{machine.get('load_average_at_start')} at start, {machine.get('load_average_at_end')} at end. "
        f"{_steal_line(machine.get('steal_by_run'))}"
        f"{_niceness_line(machine.get('worker_niceness'))}"
        "Figures: median (min–max) of the repetitions after a warm-up (throughput: every epoch after each "
        "run's first; start-up: the runs); ratios: ratio of medians (least–most favourable pairing).",
    ]
    data_parallel = results.get("data_parallel")
    dp_section: list[str] = []  # printed after the pipeline, in the order
    if data_parallel:
        work = data_parallel["workload"]
        overhead = data_parallel["ddp_overhead"]
        raypar, peer = overhead["raypar"], overhead["torch"]
        n = overhead["num_workers"]
        parts += [
            "",
            f"## 1. DDP overhead: raypar vs torch.multiprocessing.spawn + gloo, {n} workers",
            "",
            f"{workload_line(work)}; 1 CPU and 1 torch thread per worker; "
            f"{len(overhead['raw']['raypar'])} raypar / {len(overhead['raw']['torch'])} torch repetitions.",
            "",
            markdown_table(
                ["measure", "raypar DDP (Ray Train)", "torch DDP (spawn, gloo)", "raypar / torch"],
                [
                    [
                        "steady samples/s (epoch loops only)",
                        fmt(raypar["samples_per_second"]),
                        fmt(peer["samples_per_second"]),
                        fmt(overhead["samples_per_second_ratio"], ".3f"),
                    ],
                    [
                        f"the same, epochs with <= {QUIET_STEAL:.0%} CPU steal only",
                        _quiet_cell(raypar),
                        _quiet_cell(peer),
                        fmt(overhead.get("quiet_samples_per_second_ratio"), ".3f"),
                    ],
                    [
                        "fixed cost, s: wall - loop time (start-up, final checkpoint, teardown)",
                        fmt(raypar["startup_s"], ".1f"),
                        fmt(peer["startup_s"], ".1f"),
                        fmt(overhead["startup_ratio"], ".1f"),
                    ],
                    [
                        "start-up, s: job start to first step",
                        fmt(raypar.get("first_step_s"), ".2f"),
                        fmt(peer["first_step_s"], ".2f"),
                        fmt(overhead.get("first_step_ratio"), ".1f"),
                    ],
                    [
                        "the rest, s: wall - start-up - loop (between epochs, final checkpoint, teardown)",
                        fmt(raypar.get("after_loop_s"), ".2f"),
                        fmt(peer.get("after_loop_s"), ".2f"),
                        "-",
                    ],
                    ["total wall, s", fmt(raypar["wall_s"], ".1f"), fmt(peer["wall_s"], ".1f"), "-"],
                    [
                        "peak RSS per worker (the largest), MiB",
                        fmt(raypar.get("peak_rss_bytes"), ".0f", 1 / MIB),
                        fmt(peer["peak_rss_bytes"], ".0f", 1 / MIB),
                        fmt(overhead.get("peak_rss_ratio"), ".2f"),
                    ],
                    [
                        "CPU steal by the hypervisor, share of each run",
                        fmt(raypar.get("steal_fraction"), ".1%"),
                        fmt(peer.get("steal_fraction"), ".1%"),
                        "-",
                    ],
                ],
            ),
            "",
            "## 2. DDP scaling",
            "",
            f"{workload_line(work)}; the cluster has {data_parallel['scaling']['cluster_cpus']} CPUs; "
            "efficiency = samples/s(N) / (N x samples/s(1)).",
            "",
            markdown_table(
                ["workers", "samples/s", "speed-up vs 1", "efficiency"],
                [
                    [
                        p["num_workers"],
                        fmt(p["samples_per_second"]),
                        fmt(p["speedup"], ".2f"),
                        fmt(p["efficiency"], ".2f"),
                    ]
                    for p in data_parallel["scaling"]["points"]
                ],
            ),
        ]
        dp_vs_ddp = data_parallel["dp_vs_ddp"]
        dp_section += ["", f"## 4. DataParallel vs DDP on one node ({n} CPUs each)", ""]
        if "skipped" in dp_vs_ddp:
            dp_section += [f"Skipped: {dp_vs_ddp['skipped']}."]
        else:
            dp_section += [
                f"DataParallel: one worker holding {n} CPUs ({n} torch threads; `nn.DataParallel` only splits "
                f"over GPUs, so on CPU it is the plain model); DDP: {n} workers x 1 CPU.",
                "",
                markdown_table(
                    ["strategy", "samples/s", "DDP / DataParallel"],
                    [
                        ["DDP", fmt(dp_vs_ddp["ddp"]["samples_per_second"]), fmt(dp_vs_ddp["ddp_over_dp"], ".2f")],
                        ["DataParallel", fmt(dp_vs_ddp["dp"]["samples_per_second"]), "-"],
                    ],
                ),
            ]
    pipe = results.get("pipeline")
    if pipe:
        work, single = pipe["workload"], pipe["single_process"]
        parts += [
            "",
            f"## 3. Pipeline: {pipe['num_stages']} stage actors",
            "",
            f"{workload_line(work)}; {pipe['threads_per_stage']} CPU and torch thread per stage. "
            f"Single process (plain torch loop, whole model, {single['num_threads']} thread): "
            f"{fmt(single['samples_per_second'])} samples/s. Bubble: share of the stages' time (wall x S) "
            "spent neither in forward/backward nor in the optimizer step (which every schedule runs once "
            "per batch, outside the fill and drain the theory counts); waiting, transfers and dispatch are "
            "bubble. Theory: GPipe (S-1)/(M+S-1), equal stages and free transfers. "
            "`(= sequential)`: the same op order on every stage, so one run reported under both names. "
            "`vs sequential` = `busy share` x `op speed` (medians, so nearly): the stages' busy share "
            "(1 - bubble) over the sequential runs' is what the schedule overlaps; samples per second "
            "of busy stage time over theirs is how fast the ops ran, which two stages computing at "
            "once, or a slow phase of the host, lowers whatever the schedule.",
            "",
            markdown_table(
                [
                    "M",
                    "schedule",
                    "transport",
                    "samples/s",
                    "vs sequential",
                    "busy share",
                    "op speed",
                    "vs single process",
                    "bubble",
                    "bubble theory",
                ],
                [
                    [
                        r["num_microbatches"],
                        r["schedule"] + (f" (= {r['same_ops_as']})" if r["same_ops_as"] else ""),
                        r["transport"],
                        fmt(r["samples_per_second"]),
                        fmt(r["speedup_vs_sequential"], ".2f"),
                        *_speedup_parts_cells(r),
                        fmt(r["speedup_vs_single_process"], ".2f"),
                        fmt(r["bubble_fraction"], ".3f"),
                        f"{r['bubble_theory']:.3f}" if r["bubble_theory"] is not None else "-",
                    ]
                    for r in pipe["configs"]
                ],
            ),
            "",
            f"### Where the stages' time goes (M={pipe['target_microbatches']})",
            "",
            "Shares of wall x S; `p2p calls`: gloo's send, receive-post and send-wait calls (p2p only); "
            "`other`: dispatch and Python between ops (and, for "
            "transports other than p2p, waiting, which only p2p measures apart). `schedule, measured "
            "ops`: the bubble of the schedule replayed with every op's and optimizer step's measured "
            "duration and instant transfers; `schedule, median ops`: the same with each stage's "
            "forwards, backwards and steps each at that stage's median. So theory to median ops is "
            "the cut (uneven stages, the optimizer steps); median to measured ops is the jitter of "
            "single ops (a slow op holds up the stage waiting for it); measured ops to the bubble is "
            "raypar's own cost (transfers, wake-ups, dispatch). `busiest stage`: "
            "the idle share of the stage with the most compute and optimizer time, which sets the pace; "
            "`imbalance`: that time over the least busy stage's. The gap between the bubble and the busiest stage's "
            "is the other stages idling because the cut is uneven.",
            "",
            markdown_table(
                [
                    "schedule",
                    "transport",
                    "compute",
                    "optimizer",
                    "receive wait",
                    "p2p calls",
                    "other",
                    "bubble",
                    "theory, equal stages",
                    "schedule, median ops",
                    "schedule, measured ops",
                    "busiest stage",
                    "imbalance",
                ],
                [
                    [
                        r["schedule"],
                        r["transport"],
                        *_time_shares(r),
                        fmt(r["bubble_fraction"], ".3f"),
                        f"{r['bubble_theory']:.3f}" if r["bubble_theory"] is not None else "-",
                        fmt(r.get("bubble_schedule_median_ops"), ".3f"),
                        fmt(r["bubble_schedule_measured_ops"], ".3f"),
                        fmt(r.get("bubble_busiest_stage"), ".3f"),
                        fmt(r.get("stage_imbalance"), ".2f"),
                    ]
                    for r in pipe["configs"]
                    if r["num_microbatches"] == pipe["target_microbatches"] and not r["same_ops_as"]
                ],
            ),
            "",
            "### Transfer cost per micro-batch (sequential schedule: no compute overlaps)",
            "",
            "µs per transfer = (step time - critical path) / (2 (S-1) M), the critical path being every "
            "stage's forward and backward plus the first stage's optimizer step (each later stage steps "
            "while the gradient travels upstream); an upper bound, since the uncovered time also holds "
            "the driver's dispatch. "
            "Bytes = micro-batch rows x width x 4.",
            "",
            markdown_table(
                [
                    "M",
                    "micro-batch rows",
                    "bytes per transfer",
                    "transport",
                    "step ms",
                    "critical path ms",
                    "µs per transfer",
                ],
                [
                    [
                        r["num_microbatches"],
                        work["batch_size"] // r["num_microbatches"],
                        f"{r['bytes_per_transfer']:,}",
                        r["transport"],
                        fmt(r["step_s"], ".1f", 1e3),
                        fmt(r["critical_s"], ".1f", 1e3),
                        fmt(r["transfer_us"], ",.0f"),
                    ]
                    for r in pipe["configs"]
                    if r["schedule"] == "sequential"
                ],
            ),
        ]
        if pipe["transports"]:
            parts += [
                "",
                "### Transports",
                "",
                f"`{PIPELINE_TRANSPORT}` (the default): torch.distributed send/recv between the stage actors, one "
                "actor call per stage per few batches (`--batches-per-call`); "
                "`compiled`: a Ray Compiled Graph, one node per op; "
                "`actor_calls`: one Ray actor call per op, activations as object references.",
                "",
                markdown_table(
                    [
                        "schedule",
                        "M",
                        *[f"{t} samples/s" for t in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
                        *[f"{PIPELINE_TRANSPORT} / {t}" for t in OTHER_TRANSPORTS],
                        *[f"{t} bubble" for t in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
                    ],
                    [
                        [
                            t["schedule"],
                            t["num_microbatches"],
                            *[fmt(t[k]["samples_per_second"]) for k in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
                            *[fmt(t[f"{PIPELINE_TRANSPORT}_over_{k}"], ".2f") for k in OTHER_TRANSPORTS],
                            *[fmt(t[k]["bubble_fraction"], ".3f") for k in (PIPELINE_TRANSPORT, *OTHER_TRANSPORTS)],
                        ]
                        for t in pipe["transports"]
                    ],
                ),
            ]
    parts += dp_section
    ingest = results.get("ingest")
    if ingest:
        parts += [
            "",
            "## 5. Data ingest: Parquet to training batches in one Ray worker",
            "",
            f"{ingest['rows']:,} rows, {ingest['file_bytes'] / MIB:.2f} MiB (the DDP data). raypar: `read_dataset` "
            "(read + validate) plus one epoch of the loop's batch indexing; one worker producing every global "
            "batch, against the whole DDP job's consumption (conservative: a DDP worker indexes 1/N of each). "
            f"Worker RSS: {ingest['worker_rss_at_start_bytes'] / MIB:.0f} MiB at start, "
            f"{ingest['worker_peak_rss_bytes'] / MIB:.0f} MiB peak.",
            "",
            markdown_table(
                ["path", "rows/s", "ratio"],
                [
                    ["pyarrow.parquet.read_table alone", fmt(ingest["pyarrow_rows_per_second"]), "-"],
                    [
                        "raypar read_dataset + batch indexing",
                        fmt(ingest["raypar_rows_per_second"]),
                        fmt(ingest["raypar_over_pyarrow"], ".2f") + " of pyarrow",
                    ],
                    [
                        "DDP training consumption (samples/s)",
                        fmt(ingest["ddp_samples_per_second"]),
                        fmt(ingest["ingest_over_training"], ".1f") + "x headroom"
                        if ingest["ingest_over_training"]
                        else "-",
                    ],
                ],
            ),
        ]
    parts += _stage_memory_section(results.get("stage_memory"))
    parts += _stream_section(results.get("stream_ingest"))
    parts += _accumulation_section(results.get("accumulation"))
    parts += _lm_section(results.get("lm"))
    from ray_jobs.bench.report_gpu import gpu_sections  # here: it uses this module's helpers
    from ray_jobs.bench.report_sharding import sharding_section

    parts += sharding_section(results.get("sharding"))
    parts += gpu_sections(results)
    on = "GPU, nccl" if results["suite"] == "gpu" else "CPU, gloo"
    parts += [
        "",
        f"## Targets (this machine: {on}; reported, not asserted)",
        "",
        markdown_table(
            ["target", "goal", "measured", "target"],
            [
                [
                    t["name"],
                    t["goal"],
                    fmt(t["measured"], "+.3f" if t.get("unit") == "points" else ".2f") if t["measured"] else "-",
                    t["status"],
                ]
                for t in results["targets"]
            ],
        ),
        "",
        "A target is `met` or `missed` when the median and both ends of its range agree; `within noise` "
        "when the range (least–most favourable pairing) reaches across the goal: more repetitions or a "
        "quieter machine decide it.",
        "",
        f"Plots: {', '.join(results['plots']) or 'none for these cases'}."
        if isinstance(results["plots"], list)
        else f"{results['plots']}.",
    ]
    return "\n".join(parts) + "\n"


def _stage_memory_section(memory: dict[str, Any] | None) -> list[str]:
    if not memory:
        return []
    rows = []
    for row in memory["rows"]:
        for stage, (params, rss, device) in enumerate(
            zip(row["stage_parameter_bytes"], row["stage_peak_rss_bytes"], row["stage_peak_device_bytes"])
        ):
            rows.append(
                [
                    row["num_stages"],
                    stage,
                    f"{params / MIB:.1f}",
                    f"{rss / MIB:.0f}",
                    f"{device / MIB:.0f}" if device is not None else "-",
                ]
            )
    return [
        "",
        "## 6. Pipeline stage memory: one model, more stages",
        "",
        f"{workload_line(memory['workload'])}; {memory['cpus_per_stage']:g} CPU per stage. Each stage builds only its "
        "own layers (the model exists whole on the meta device only) and is sent only its slice of the weights; "
        "peak RSS is the stage process's VmHWM over the whole run (weights, gradients, optimizer state, "
        "activations, and the ~300 MiB of torch and pyarrow every process holds).",
        "",
        markdown_table(["stages", "stage", "its parameters, MiB", "peak RSS, MiB", "peak GPU memory, MiB"], rows),
    ]


def _stream_section(stream: dict[str, Any] | None) -> list[str]:
    if not stream:
        return []
    runs = stream["runs"]
    rows = [
        [
            run["data"],
            f"{run['rows']:,}",
            f"{run['file_bytes'] / MIB:,.0f}",
            run["ingest"],
            f"{run['driver_peak_rss_bytes'] / MIB:,.0f}",
            f"{max(run['worker_peak_rss_bytes']) / MIB:,.0f}",
            f"{run['samples_per_second']:,.0f}",
            f"{run['data_wait_fraction']:.3f}",
            f"{run['bytes_read'] / (run['file_bytes'] * stream['workload']['epochs']):.2f}",
        ]
        for run in runs
    ]
    growth = [
        [mode, f"{g['file_bytes'] / MIB:,.0f}", f"{g['driver_bytes'] / MIB:+,.0f}", f"{g['worker_bytes'] / MIB:+,.0f}"]
        for mode, g in stream["growth"].items()
    ]
    fastest = max(run["samples_per_second"] for run in runs if run["ingest"] == "stream")
    return [
        "",
        "## 7. Streaming ingest: 16x the data, and what each process holds",
        "",
        f"{workload_line(stream['workload'])} (the large data; the small one has 1/16 of its rows); DDP with "
        f"{stream['num_workers']} workers, each driver a process of its own (its peak RSS is its own). `memory` "
        "reads the data whole in the driver and maps it into every worker; `stream` reads it window by window "
        "through one reader actor. The stream's reader alone delivered "
        f"{stream['reader_rows_per_second']:,.0f} rows/s, {stream['reader_rows_per_second'] / fastest:.1f}x the "
        "fastest streamed DDP run's consumption.",
        "",
        markdown_table(
            [
                "data",
                "rows",
                "file, MiB",
                "ingest",
                "driver peak RSS, MiB",
                "largest worker peak RSS, MiB",
                "samples/s",
                "data wait",
                "bytes read per epoch / file",
            ],
            rows,
        ),
        "",
        markdown_table(["ingest", "more data, MiB", "driver peak RSS, MiB", "worker peak RSS, MiB"], growth),
    ]


def _accumulation_section(accum: dict[str, Any] | None) -> list[str]:
    if not accum:
        return []
    base, most = accum["runs"][0], accum["runs"][-1]
    k1, k = base["grad_accum_steps"], most["grad_accum_steps"]
    saved_ratio = most["saved_activation_peak_bytes"] / base["saved_activation_peak_bytes"]
    return [
        "",
        f"## 8. Gradient accumulation: K={k} against K={k1} at one global batch",
        "",
        f"{workload_line(accum['workload'])}; raypar DDP, {accum['num_workers']} workers x 1 CPU, each taking "
        f"{accum['rows_per_worker']:,} rows of every global batch in K micro-steps (`--grad-accum-steps K`: one "
        "all-reduce and one optimizer step per global batch). Peak RSS: each worker process's VmHWM over the "
        "whole fit, the largest worker's (weights, gradients, activations, the data, and the ~500 MiB torch and "
        "Ray hold in any worker); on Linux, glibc's malloc keeps freed blocks below its mmap threshold (which "
        "rises to 32 MiB) in its heap, so a worker's RSS need not fall with K even where its live tensors do "
        "(docs/performance.md). Activations: the bytes autograd holds for backward at the step's peak, read "
        "with `torch.autograd.graph.saved_tensors_hooks` over one worker's step (`train_step` on its rows of "
        "one global batch, replayed in the bench's process): every saved tensor's bytes from its forward "
        "until its graph is freed, once however many ops save it, parameters not counted, nor the gradients "
        "of activations during backward.",
        "",
        markdown_table(
            ["measure", f"K={k1}", f"K={k}", f"K={k} / K={k1}"],
            [
                [
                    "steady samples/s (epoch loops only)",
                    fmt(base["samples_per_second"]),
                    fmt(most["samples_per_second"]),
                    fmt(accum["samples_per_second_ratio"], ".2f"),
                ],
                [
                    "peak RSS per worker (the largest), MiB",
                    fmt(base["peak_rss_bytes"], ".0f", 1 / MIB),
                    fmt(most["peak_rss_bytes"], ".0f", 1 / MIB),
                    fmt(accum["peak_rss_ratio"], ".2f"),
                ],
                [
                    "activations held for backward, one worker's step at its peak, MiB",
                    f"{base['saved_activation_peak_bytes'] / MIB:.1f}",
                    f"{most['saved_activation_peak_bytes'] / MIB:.1f}",
                    f"{saved_ratio:.2f}",
                ],
            ],
        ),
    ]


def _lm_section(lm: dict[str, Any] | None) -> list[str]:
    if not lm:
        return []
    work, ddp, pipe = lm["workload"], lm["ddp"], lm["pipeline"]
    n, s, m = ddp["num_workers"], pipe["num_stages"], pipe["num_microbatches"]
    return [
        "",
        "## 9. Language model: the gpt in tokens/s",
        "",
        f"`gpt` n_layer {work['n_layer']} n_head {work['n_head']} n_embd {work['n_embd']}, block_size (T) "
        f"{work['block_size']}, vocabulary {work['vocab_size']} (byte tokens of the standard library's sources), "
        f"{work['rows']:,} rows, global batch {work['batch_size']} rows ({lm['tokens_per_step']:,} tokens), "
        f"{work['epochs']} epochs of {work['rows'] // work['batch_size']} steps; `--task lm`, the mean token "
        "cross-entropy. Tokens/s = samples/s x T. DDP: raypar against the plain torch.distributed peer "
        f"(`mp.spawn`, gloo; the same gpt, weights, tokens and batch), {n} workers x 1 CPU and torch thread. "
        f"Pipeline: {s} stage actors x {pipe['threads_per_stage']} CPU, M={m} micro-batches, the p2p transport, "
        "against its sequential schedule (one micro-batch at a time through the same stages) and against the "
        f"whole gpt in one process ({pipe['threads_per_stage']} thread, the plain loop).",
        "",
        markdown_table(
            ["measure", "raypar DDP (Ray Train)", "torch DDP (spawn, gloo)", "raypar / torch"],
            [
                [
                    "steady tokens/s (epoch loops only)",
                    fmt(ddp["raypar_tokens_per_second"]),
                    fmt(ddp["torch_tokens_per_second"]),
                    fmt(ddp["tokens_per_second_ratio"], ".3f"),
                ],
                [
                    "peak RSS per worker (the largest), MiB",
                    fmt(ddp["raypar_peak_rss_bytes"], ".0f", 1 / MIB),
                    fmt(ddp["torch_peak_rss_bytes"], ".0f", 1 / MIB),
                    "-",
                ],
            ],
        ),
        "",
        markdown_table(
            ["pipeline schedule", "tokens/s", "vs sequential", "vs single process", "bubble", "bubble theory"],
            [
                [
                    r["schedule"],
                    fmt(r["tokens_per_second"]),
                    fmt(r["speedup_vs_sequential"], ".2f"),
                    fmt(r["speedup_vs_single_process"], ".2f"),
                    fmt(r["bubble_fraction"], ".3f"),
                    f"{gpipe_bubble(s, m):.3f}" if r["schedule"] != "sequential" else "-",
                ]
                for r in pipe["schedules"]
            ]
            + [["single process, whole gpt", fmt(pipe["single_process_tokens_per_second"]), "-", "-", "-", "-"]],
        ),
    ]


def _gpus(machine: dict[str, Any]) -> str:
    gpus = machine.get("gpus")  # absent from reports before the GPU suite
    return f"{len(gpus)} GPU ({', '.join(sorted(set(gpus)))}, CUDA {machine.get('cuda')}), " if gpus else ""


def _niceness_line(niceness: int | None) -> str:
    if niceness is None:  # a report from before the peers matched it
        return ""
    return f"Ray's workers and the plain-torch peers ran at nice {niceness}. "


def _quiet_cell(figures: dict[str, Any]) -> str:
    quiet_figure = figures.get("samples_per_second_quiet")
    return f"{fmt(quiet_figure)}, {len(quiet_figure['values'])} epochs" if quiet_figure else "no quiet epoch"


def _steal_line(runs: list[dict[str, Any]] | None) -> str:
    if not runs:
        return ""
    worst = max(runs, key=lambda r: r["steal_fraction"])
    median = statistics.median(r["steal_fraction"] for r in runs)
    return (
        f"CPU time taken by the hypervisor (steal) during the measured runs: median {median:.1%}, "
        f"most {worst['steal_fraction']:.1%} ({worst['run']}). "
    )


def _speedup_parts_cells(row: dict) -> list[str]:
    """The split computed when the row was measured; ``-`` without a baseline, or in a report
    that predates it."""
    parts = row.get("speedup_vs_sequential_parts")
    return [fmt(parts[k], ".2f") for k in ("busy_share", "op_speed")] if parts else ["-", "-"]


def _time_shares(row: dict) -> list[str]:
    """The measured shares, ``-`` for one a report predates, and the rest as ``other``."""
    known = [row["time_fractions"].get(k) for k in TIME_SHARES]
    medians = [share["median"] for share in known if share]
    return [*(f"{share['median']:.3f}" if share else "-" for share in known), f"{1.0 - sum(medians):.3f}"]


def workload_line(work: dict[str, Any]) -> str:
    return (
        f"`{work['model']}` hidden {work['hidden']} depth {work['depth']}, {work['in_features']} -> "
        f"{work['out_features']}, {work['rows']:,} rows, global batch {work['batch_size']}, "
        f"{work['epochs']} epoch{'s' if work['epochs'] != 1 else ''} of {work['rows'] // work['batch_size']} steps"
    )
