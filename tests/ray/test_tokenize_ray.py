"""``tokenize --ray``: Ray Data tasks read and encode the inputs on the shared cluster; the rows
are the single process's, row for row."""

from __future__ import annotations

import gzip
import io
import json
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_jobs.data import tokenize_ray, tokenized
from ray_jobs.data.__main__ import main
from ray_jobs.data.parquet import read_dataset

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Every kind of input: text files (one with bytes that are not UTF-8), a Parquet file of three
    row groups with a null text, and gzipped JSON Lines; real text, the standard library's."""
    root = tmp_path_factory.mktemp("corpus")
    texts = [path.read_text() for path in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py"))]
    for index, text in enumerate(texts[:2]):
        (root / f"a{index}.txt").write_text(text)
    (root / "b-latin1.txt").write_bytes("café au lait\n".encode("latin-1") * 20)
    column = pa.array([texts[2], None, "a short one", texts[3], "", texts[4][:500]], pa.string())
    pq.write_table(pa.table({"text": column}), root / "c.parquet", row_group_size=2)
    with gzip.open(root / "d.jsonl.gz", "wt") as stream:
        for text in texts[:3]:
            stream.write(json.dumps({"text": text[::-1]}) + "\n")
    return root


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_the_rows_are_the_single_processes_row_for_row(ray_cluster, corpus, tmp_path, kind):
    """The same inputs through one process and through Ray Data tasks (a task per file, per Parquet
    row group): the same rows in the same order, split into shards of whole row groups, the same
    held-out documents, the same tokenizer file and the same counts."""
    options = {"kind": kind, "vocab_size": 300 if kind == "bpe" else None, "val_fraction": 0.25, "seed": 3}
    options["row_group_rows"] = 16
    one = tokenized.tokenize([str(corpus)], str(tmp_path / "one"), 8, progress_out=io.StringIO(), **options)
    spread = tokenize_ray.tokenize(
        [str(corpus)], str(tmp_path / "ray"), 8, shard_rows=40, progress_out=io.StringIO(), **options
    )
    for index, split in enumerate(("train", "val")):
        shards = sorted(path.name for path in (tmp_path / "ray" / split).iterdir())
        assert shards == [f"{split}-{i:05d}-of-{len(shards):05d}.parquet" for i in range(len(shards))]
        assert len(shards) == spread.splits[index].shards and (len(shards) > 1 or split == "val")
        expected = read_dataset(str(tmp_path / "one" / f"{split}.parquet"))
        got = read_dataset(str(tmp_path / "ray" / split))  # the shards as one dataset, as --data reads them
        np.testing.assert_array_equal(got.features, expected.features)
        assert got.tokenizer == expected.tokenizer and got.num_classes == expected.num_classes
        for field in ("rows", "tokens", "dropped"):
            assert getattr(spread.splits[index], field) == getattr(one.splits[index], field)
    assert (tmp_path / "ray" / "tokenizer.json").read_bytes() == (tmp_path / "one" / "tokenizer.json").read_bytes()
    assert (spread.documents, spread.skipped, spread.replaced) == (one.documents, one.skipped, one.replaced)
    assert spread.replaced == {str(corpus / "b-latin1.txt"): 20}
    assert not list((tmp_path / "ray").rglob("*.partial"))


def test_bad_input_is_one_error_line_and_leaves_the_last_dataset_whole(ray_cluster, corpus, tmp_path, capsys):
    """A task meets a line that is not JSON: one ``error:`` line naming it, no traceback; the
    output keeps what an earlier run wrote, and nothing of this one."""
    out = tmp_path / "out"
    common = ["tokenize", "--ray", "--output", str(out), "--block-size", "8"]
    assert main([*common, "--input", str(corpus / "a0.txt")]) == 0
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert "(1 shard)" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    assert main([*common, "--input", str(corpus / "a1.txt"), str(tmp_path / "bad.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"error: --input {tmp_path / 'bad.jsonl'}:2 is not JSON" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


def test_a_cluster_with_every_cpu_held_is_refused_not_waited_on(ray_cluster, corpus, tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.0})
    with pytest.raises(ValueError, match="every CPU of the Ray cluster is held"):
        tokenize_ray.tokenize([str(corpus / "a0.txt")], str(tmp_path / "out"), 8, progress_out=io.StringIO())
    assert not (tmp_path / "out").exists()


def test_a_bucket_in_and_out_and_a_failed_run_leaves_no_dataset(ray_cluster, s3_endpoint, corpus, tmp_path):
    """Inputs read from S3 by the tasks (moto; the endpoint in the URIs' query), shards written to
    it; a run that fails part-way leaves no shard and no tokenizer in the bucket."""
    import uuid

    import pyarrow.fs as pafs

    from ray_jobs.data import storage

    bucket = f"raypar-{uuid.uuid4().hex[:8]}"
    pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http", allow_bucket_creation=True).create_dir(bucket)
    query = f"?endpoint_override={s3_endpoint}&scheme=http"
    for path in sorted(corpus.iterdir()):
        storage.write_bytes(f"s3://{bucket}/in/{path.name}{query}", path.read_bytes())
    options = {"val_fraction": 0.25, "row_group_rows": 16, "progress_out": io.StringIO()}
    tokenize_ray.tokenize([f"s3://{bucket}/in{query}"], f"s3://{bucket}/out{query}", 8, shard_rows=40, **options)
    tokenized.tokenize([str(corpus)], str(tmp_path / "one"), 8, **options)
    for split in ("train", "val"):
        got = read_dataset(f"s3://{bucket}/out/{split}{query}")
        np.testing.assert_array_equal(got.features, read_dataset(str(tmp_path / "one" / f"{split}.parquet")).features)

    storage.write_bytes(f"s3://{bucket}/in/z.jsonl{query}", b'{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match="is not JSON"):
        tokenize_ray.tokenize([f"s3://{bucket}/in{query}"], f"s3://{bucket}/failed{query}", 8, **options)
    assert not storage.exists(f"s3://{bucket}/failed/tokenizer.json{query}")
    filesystem, path = storage.resolve(f"s3://{bucket}/failed{query}")
    left = filesystem.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    assert not [info.path for info in left if info.type == pafs.FileType.File]
