"""``python -m ray_jobs.data tokenize``: rows of T+1 consecutive tokens of the documents joined by
end-of-text, checked against a stream built by hand; every bad input one ``error:`` line, nothing written."""

from __future__ import annotations

import gzip
import io
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ray_jobs.data import documents
from ray_jobs.data.__main__ import main
from ray_jobs.data.tokenizer import TOKENIZER_KEY, VOCAB_SIZE_KEY, read_tokenizer, tokenizer_from_json

EOT = 256  # the byte tokenizer's end-of-text
DOCS = ["first document\n", "second — with ü and 🎉\n", "third\n" * 40]


def reference_stream(texts: list[str]) -> list[int]:
    """The byte tokenizer's stream, by hand: each document's UTF-8 bytes, then end-of-text."""
    return [token for text in texts for token in [*text.encode("utf-8"), EOT]]


def read_rows(path) -> list[list[int]]:
    table = pq.read_table(path)
    assert table.schema.names == ["tokens"] and table.schema.field("tokens").type == pa.list_(pa.int32())
    return table.column("tokens").to_pylist()


def expected_rows(stream: list[int], block_size: int) -> list[list[int]]:
    """Row i is stream[i*T : i*T+T+1]; the tail that fills no row is dropped."""
    count = (len(stream) - 1) // block_size
    return [stream[i * block_size : i * block_size + block_size + 1] for i in range(count)]


def write_docs(folder, texts=DOCS) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index, text in enumerate(texts):
        (folder / f"doc{index}.txt").write_text(text, encoding="utf-8")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["tokenize", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("block_size", [1, 7, 64])
def test_text_files_become_overlapping_rows_of_the_joined_stream(tmp_path, capsys, block_size):
    write_docs(tmp_path / "in")
    code, out, err = run(capsys, "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                         "--block-size", str(block_size), "--row-group-rows", "5")  # fmt: skip
    assert code == 0, err
    rows = read_rows(tmp_path / "out" / "train.parquet")
    stream = reference_stream(DOCS)
    assert rows == expected_rows(stream, block_size)
    assert all(a[-1] == b[0] for a, b in zip(rows, rows[1:]))  # consecutive rows share one token
    assert pq.ParquetFile(tmp_path / "out" / "train.parquet").metadata.row_group(0).num_rows == min(5, len(rows))
    metadata = pq.read_schema(tmp_path / "out" / "train.parquet").metadata
    assert metadata[VOCAB_SIZE_KEY] == b"257"
    assert tokenizer_from_json(metadata[TOKENIZER_KEY]).kind == "byte"
    assert read_tokenizer(str(tmp_path / "out")).kind == "byte"
    assert f"{len(stream):,} tokens" in out and f"{len(rows):,} rows of {block_size + 1} tokens" in out
    assert not (tmp_path / "out" / "val.parquet").exists()


def test_json_lines_parquet_globs_and_gzip_are_documents(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"id": i, "body": t}) for i, t in enumerate(DOCS)) + "\n\n")
    pq.write_table(pa.table({"body": ["from parquet", None, "ü"], "n": [1, 2, 3]}), tmp_path / "b.parquet")
    with gzip.open(tmp_path / "c.json.gz", "wt") as stream:
        stream.write(json.dumps({"body": "zipped"}) + "\n")
    (tmp_path / "d.txt").write_text("plain")
    code, out, err = run(capsys, "--input", str(tmp_path / "*.json*"), str(tmp_path / "b.parquet"),
                         str(tmp_path / "d.txt"), "--output", str(tmp_path / "out"), "--block-size", "4",
                         "--text-column", "body")  # fmt: skip
    assert code == 0, err
    texts = [*DOCS, "zipped", "from parquet", "ü", "plain"]  # input order: the glob's matches sorted, then the rest
    assert read_rows(tmp_path / "out" / "train.parquet") == expected_rows(reference_stream(texts), 4)
    assert "skipped 1 records whose text is null" in out


def test_bpe_rows_decode_back_to_the_documents(tmp_path, capsys):
    write_docs(tmp_path / "in", [text * 20 for text in DOCS])
    code, out, err = run(capsys, "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                         "--block-size", "16", "--tokenizer", "bpe", "--vocab-size", "300")  # fmt: skip
    assert code == 0, err
    tokenizer = read_tokenizer(str(tmp_path / "out" / "tokenizer.json"))
    assert tokenizer.kind == "bpe" and 257 < tokenizer.vocab_size <= 300  # this little text has fewer merges
    if tokenizer.vocab_size < 300:
        assert f"vocabulary {tokenizer.vocab_size} (of --vocab-size 300: the text has no more merges)" in out
    rows = read_rows(tmp_path / "out" / "train.parquet")
    stream = rows[0] + [token for row in rows[1:] for token in row[1:]]
    reference = [t for text in DOCS for t in [*tokenizer.encode(text * 20), tokenizer.eot_id]]
    assert stream == reference[: len(stream)] and len(reference) - len(stream) < 16
    metadata = pq.read_schema(tmp_path / "out" / "train.parquet").metadata
    assert (
        metadata[VOCAB_SIZE_KEY] == str(tokenizer.vocab_size).encode()
        and json.loads(metadata[TOKENIZER_KEY])["kind"] == "bpe"
    )


def test_val_fraction_holds_out_whole_documents_deterministically(tmp_path, capsys):
    texts = [f"document number {index}: " + "x" * (index % 7) + "\n" for index in range(200)]
    write_docs(tmp_path / "in", texts)
    outputs = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        code, _, err = run(capsys, "--input", str(tmp_path / "in"), "--output", str(tmp_path / name),
                           "--block-size", "8", "--val-fraction", "0.2", "--seed", seed)  # fmt: skip
        assert code == 0, err
        outputs.append([read_rows(tmp_path / name / f"{split}.parquet") for split in ("train", "val")])
    assert outputs[0] == outputs[1]  # same input, same seed: the same split
    assert outputs[0] != outputs[2]
    held_out = []
    for rows in outputs[0]:
        stream = rows[0] + [token for row in rows[1:] for token in row[1:]]
        # whole documents: each split's stream is documents joined by end-of-text (the tail cut aside)
        documents_seen = [bytes(part).decode() for part in _split(stream)]
        assert all(doc in texts for doc in documents_seen[:-1])
        held_out.append(len(documents_seen))
    assert held_out[1] in (40, 41)  # every 5th of 200 documents, the last cut or not by the dropped tail


def _split(stream: list[int]) -> list[list[int]]:
    parts, current = [], []
    for token in stream:
        if token == EOT:
            parts.append(current)
            current = []
        else:
            current.append(token)
    return parts + [current]


def test_a_long_document_is_read_in_pieces_with_the_same_tokens(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(documents, "TEXT_PIECE_BYTES", 5)  # cuts inside multi-byte characters too
    text = "line ü one\nzwei 🎉🎉\n\nlast line without end"
    write_docs(tmp_path / "in", [text])
    code, _, err = run(capsys, "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--block-size", "3")
    assert code == 0, err
    assert read_rows(tmp_path / "out" / "train.parquet") == expected_rows(reference_stream([text]), 3)


def test_bad_bytes_are_replaced_and_counted_not_fatal(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "bad.txt").write_bytes(b"ab\xff\xfecd\xc3")  # two stray bytes and a cut-off character
    (tmp_path / "in" / "good.txt").write_text("fine")
    code, out, err = run(
        capsys, "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--block-size", "2"
    )
    assert code == 0, err
    assert f"replaced 3 bytes that are not UTF-8 with U+FFFD in 1 files: {tmp_path / 'in' / 'bad.txt'} (3)" in out
    texts = ["ab\ufffd\ufffdcd\ufffd", "fine"]
    assert read_rows(tmp_path / "out" / "train.parquet") == expected_rows(reference_stream(texts), 2)


def test_a_rerun_without_val_removes_the_stale_val_split_and_skips_its_own_output(tmp_path, capsys):
    write_docs(tmp_path / "in", [f"doc {i}\n" * 5 for i in range(50)])
    out_dir = tmp_path / "in" / "tokens"  # the output inside the input folder: not read back as input
    argv = ["--input", str(tmp_path / "in"), "--output", str(out_dir), "--block-size", "4"]
    assert run(capsys, *argv, "--val-fraction", "0.3")[0] == 0
    assert (out_dir / "val.parquet").exists()
    code, _, err = run(capsys, *argv)
    assert code == 0, err
    assert sorted(path.name for path in out_dir.iterdir()) == ["tokenizer.json", "train.parquet"]


def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, capsys):
    write_docs(tmp_path / "in", ["short"])
    pq.write_table(pa.table({"content": ["x"], "id": [1]}), tmp_path / "table.parquet")
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    (tmp_path / "nofield.jsonl").write_text('{"body": "ok"}\n')
    (tmp_path / "afile").write_text("x")
    text_in = ["--input", str(tmp_path / "in")]
    cases = [
        ([*text_in, "--block-size", "8"], "error: the text has 6 tokens, fewer than one block of 9 (--block-size 8)"),
        (
            ["--input", str(tmp_path / "*.md"), "--block-size", "2"],
            f"--input {tmp_path / '*.md'}: no input files matched",
        ),
        (["--input", str(tmp_path / "nope"), "--block-size", "2"], f"--input {tmp_path / 'nope'}: no such file or"),
        ([*text_in, "--block-size", "0"], "--block-size must be at least 1, got 0"),
        (
            [*text_in, "--block-size", "2", "--tokenizer", "bpe", "--vocab-size", "100"],
            "--vocab-size must be at least 257",
        ),
        ([*text_in, "--block-size", "2", "--vocab-size", "300"], "the byte tokenizer's vocabulary is 257"),
        ([*text_in, "--block-size", "2", "--tokenizer", "wordpiece"], "--tokenizer 'wordpiece' is unknown"),
        ([*text_in, "--block-size", "2", "--val-fraction", "1.5"], "--val-fraction must be in [0, 1), got 1.5"),
        ([*text_in, "--block-size", "2", "--val-fraction", "0.5", "--seed", "0"], "the training split has 0 of"),
        (
            [*text_in, "--block-size", "8", "--val-fraction", "0.1"],
            "error: the text has 6 tokens, fewer than one block",
        ),
        ([*text_in, "--block-size", "2", "--val-fraction", "0.1"], "--val-fraction 0.1 held out 0 tokens, fewer than"),
        (
            ["--input", str(tmp_path / "table.parquet"), "--block-size", "2"],
            f"--input {tmp_path / 'table.parquet'} has no column 'text' (--text-column); its columns: content, id",
        ),
        (
            ["--input", str(tmp_path / "broken.jsonl"), "--block-size", "2"],
            f"{tmp_path / 'broken.jsonl'}:2 is not JSON",
        ),
        (["--input", str(tmp_path / "nofield.jsonl"), "--block-size", "2"], "nofield.jsonl:1 has no 'text' field"),
        ([*text_in, "--block-size", "2", "--output", str(tmp_path / "afile")], "is a file: name a directory"),
    ]
    for argv, message in cases:
        full = ["--output", str(tmp_path / "out"), *argv] if "--output" not in argv else argv
        code, out, err = run(capsys, *full)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0] and lines[0].startswith("error:"), (argv, err)
        assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir()), argv


def test_large_input_shows_progress_lines_on_stderr(tmp_path, monkeypatch):
    from ray_jobs.data import tokenized

    write_docs(tmp_path / "in")
    log = io.StringIO()  # not a terminal: lines only for large input, one per PROGRESS_LINE_S
    tokenized.tokenize([str(tmp_path / "in")], str(tmp_path / "quiet"), 4, progress_out=log)
    assert log.getvalue() == ""
    monkeypatch.setattr(tokenized, "LARGE_INPUT_BYTES", 1)
    monkeypatch.setattr(tokenized, "PROGRESS_LINE_S", 0.0)
    tokenized.tokenize([str(tmp_path / "in")], str(tmp_path / "out"), 4, kind="bpe", vocab_size=260, progress_out=log)
    lines = log.getvalue().splitlines()
    assert any(line.startswith("training bpe: reading: ") for line in lines)
    assert any(line.startswith("training bpe: learning the merges: 100% of") for line in lines)
    assert lines[-1].startswith("tokenize: 100% of ") and "M tokens/s" in lines[-1]


def test_without_the_tokenizers_library_bpe_is_one_line_and_byte_still_works(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    write_docs(tmp_path / "in")
    argv = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--block-size", "4"]
    code, _, err = run(capsys, *argv, "--tokenizer", "bpe")
    assert code == 2 and err == "error: --tokenizer bpe needs the tokenizers library: pip install 'raypar[lm]'\n"
    assert not (tmp_path / "out").exists()
    assert run(capsys, *argv)[0] == 0


def test_a_directory_gives_its_text_not_its_caches_or_binaries(tmp_path):
    from ray_jobs.data.documents import input_files

    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\x00\x01")
    (tmp_path / "pkg" / "blob.bin").write_bytes(b"abc\x00def")
    assert input_files([str(tmp_path / "pkg")]) == [str(tmp_path / "pkg" / "mod.py")]
    assert input_files([str(tmp_path / "pkg" / "blob.bin")]) == [str(tmp_path / "pkg" / "blob.bin")]  # named: read


def test_the_tokenizers_ray_workers_import_no_torch():
    """What ``tokenize --ray``'s Ray Data workers unpickle needs no torch: ~0.9 s of each one's start."""
    from tests.helpers import modules_after

    assert "torch" not in modules_after("import ray_jobs.data.tokenize_ray")
