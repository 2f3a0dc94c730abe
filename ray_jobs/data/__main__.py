"""Parquet training data: reading and validating it with pyarrow, and writing synthetic sets.

``python -m ray_jobs.data synth --out PATH ...`` writes a synthetic dataset; ``python -m
ray_jobs.data reshard DATA --out PATH --row-group-rows R`` rewrites data with smaller row groups;
``python -m ray_jobs.data tokenize --input PATH... --output DIR --block-size T`` turns text into
language-model rows.
"""

from __future__ import annotations

import sys

import pyarrow as pa

from ray_jobs.data import tokenized
from ray_jobs.data.cli import ArgumentParser
from ray_jobs.data.parquet import ROW_GROUP_ROWS, TASKS, reshard, synthesize, write_table


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m ray_jobs.data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    synth = commands.add_parser("synth", help="write a synthetic Parquet dataset")
    synth.add_argument("--out", required=True, help="output .parquet path or URI")
    synth.add_argument("--rows", type=int, default=1024)
    synth.add_argument("--in-features", type=int, default=10)
    synth.add_argument("--out-features", type=int, default=5, help="target width, or number of classes")
    synth.add_argument("--task", default="regression", help=f"one of {', '.join(TASKS)}")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument(
        "--row-group-rows",
        type=int,
        default=ROW_GROUP_ROWS,
        help=f"rows per Parquet row group, the unit a stream reads (default: {ROW_GROUP_ROWS})",
    )
    resharder = commands.add_parser("reshard", help="rewrite Parquet data with smaller row groups, for streaming")
    resharder.add_argument("data", help="Parquet file or directory, local or URI")
    resharder.add_argument("--out", required=True, help="where to write it (a file for a file, else a directory)")
    resharder.add_argument("--row-group-rows", type=int, required=True, help="rows per row group")
    add_tokenize(commands)
    args = parser.parse_args(argv)
    try:
        if args.command == "tokenize":
            return run_tokenize(args)
        if args.command == "reshard":
            rows = reshard(args.data, args.out, args.row_group_rows)
            print(f"wrote {rows} rows in row groups of at most {args.row_group_rows} to {args.out}")
            return 0
        table = synthesize(args.rows, args.in_features, args.out_features, args.task, args.seed)
        write_table(table, args.out, args.row_group_rows)
    except (ValueError, OSError, pa.ArrowInvalid) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {table.num_rows} rows ({args.task}, {args.in_features} -> {args.out_features}) to {args.out}")
    return 0


TOKENIZE_HELP = """Tokenize text into language-model rows: OUTPUT/train.parquet (and OUTPUT/val.parquet with
--val-fraction) with one column `tokens` (list<int32>), and OUTPUT/tokenizer.json. Inputs are text
files (UTF-8; a byte that is not is replaced by U+FFFD and counted), Parquet files with a text
column, and JSON Lines files (.jsonl, .ndjson, .json; one object per line), any of them .gz;
each text file, Parquet row or JSON line is one document, and documents are joined by the
end-of-text token. Row i is tokens [i*T, i*T+T] of the stream, T+1 tokens: consecutive rows share
one token, so input tokens[:-1] and target tokens[1:] make every token a target once; the tail
that fills no row is dropped. --val-fraction f holds out that share of whole documents (of a
document longer than 64 blocks, of its 64-block spans): every 1/f-th in input order, starting at a
point drawn from --seed; deterministic. Input is streamed: read a piece and written a row group at a time."""


def add_tokenize(commands) -> None:
    tokenize = commands.add_parser("tokenize", help="tokenize text into language-model rows", description=TOKENIZE_HELP)
    tokenize.add_argument(
        "--input", nargs="+", required=True, metavar="PATH", help="files, directories (recursively) or globs"
    )
    tokenize.add_argument("--output", required=True, help="directory to write (local, or a URI)")
    tokenize.add_argument("--block-size", type=int, required=True, help="T: a row holds T+1 tokens")
    tokenize.add_argument(
        "--tokenizer",
        default="byte",
        help="byte (default: 256 bytes and end-of-text), bpe (trained on the input), or a pretrained "
        "model's: its directory or tokenizer.json (its eos joins documents)",
    )
    tokenize.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"bpe: the vocabulary to train, at least 257 (default: {tokenized.BPE_VOCAB}); byte: 257",
    )
    tokenize.add_argument("--text-column", default="text", help="Parquet column or JSON field with the text")
    tokenize.add_argument(
        "--val-fraction", type=float, default=0.0, help="share of documents held out in val.parquet (default: none)"
    )
    tokenize.add_argument(
        "--seed", type=int, default=0, help="where --val-fraction's every 1/f-th document starts (default: 0)"
    )
    tokenize.add_argument(
        "--row-group-rows",
        type=int,
        default=None,
        help=f"rows per Parquet row group (default: {ROW_GROUP_ROWS}, fewer when a group would pass "
        f"{tokenized.ROW_GROUP_TOKENS:,} tokens)",
    )
    tokenize.add_argument(
        "--bpe-sample-bytes",
        type=int,
        default=tokenized.BPE_SAMPLE_BYTES,
        help="bpe: learn the merges from about this many bytes of the input, each file's first share in "
        f"proportion to its size; all of it when smaller (default: {tokenized.BPE_SAMPLE_BYTES:,})",
    )
    on_ray = tokenize.add_argument_group(
        "on a Ray cluster",
        "--ray reads and encodes the inputs as Ray Data tasks over the cluster's CPUs (a task per text or "
        "JSON Lines file, per Parquet row group); this process routes the tokens and writes the rows. The "
        "rows, their order, the val split and tokenizer.json are those the command writes without --ray, as "
        "shards: OUTPUT/train/train-00000-of-000NN.parquet ... (and OUTPUT/val/), one dataset in name order.",
    )
    on_ray.add_argument("--ray", action="store_true", help="tokenize on a Ray cluster (default: in this process)")
    on_ray.add_argument(
        "--address", default=None, help="the cluster to join (default: RAY_ADDRESS, else a new local Ray)"
    )
    on_ray.add_argument(
        "--shard-rows",
        type=int,
        default=None,
        help=f"rows per output shard, whole row groups (default: as many as hold {tokenized.SHARD_TOKENS:,} tokens)",
    )


def run_tokenize(args) -> int:
    options = {
        "kind": args.tokenizer,
        "vocab_size": args.vocab_size,
        "text_column": args.text_column,
        "val_fraction": args.val_fraction,
        "seed": args.seed,
        "row_group_rows": args.row_group_rows,
        "bpe_sample_bytes": args.bpe_sample_bytes,
    }
    if not args.ray:
        for flag in ("address", "shard_rows"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} is for --ray")
        report = tokenized.tokenize(args.input, args.output, args.block_size, **options)
    else:
        from ray_jobs.data import tokenize_ray
        from ray_jobs.driver.connect import connect  # a cluster joined as every entry point joins it

        tokenize_ray.check_cluster_flags(args.shard_rows)
        connect(args.address)
        report = tokenize_ray.tokenize(args.input, args.output, args.block_size, shard_rows=args.shard_rows, **options)
    print("\n".join(tokenized.report_lines(report, args.output, args.block_size)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
