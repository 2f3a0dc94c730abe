"""Parquet training data: reading and validating it with pyarrow, and writing synthetic sets.

``python -m ray_jobs.data synth --out PATH ...`` writes a synthetic dataset; ``python -m
ray_jobs.data reshard DATA --out PATH --row-group-rows R`` rewrites data with smaller row groups.
"""

from __future__ import annotations

import sys

import pyarrow as pa

from ray_jobs.core.config import ArgumentParser
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
    args = parser.parse_args(argv)
    try:
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


if __name__ == "__main__":
    sys.exit(main())
