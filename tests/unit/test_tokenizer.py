"""The tokenizers: byte ids are the UTF-8 bytes exactly; BPE round-trips real text; both travel as a spec."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest

from ray_jobs.data.tokenizer import (
    EOT_TEXT,
    TOKENIZER_FILE,
    ByteTokenizer,
    read_tokenizer,
    tokenizer_from_json,
    train_bpe,
)

TEXTS = [
    "",
    "hello, world\n",
    "naïve café — Zürich, Ελληνικά, 日本語, עברית",
    "emoji 🎉👩‍👩‍👧 and a zero \x00 byte, tabs\tand\r\nCRLF",
    f"text that spells the marker {EOT_TEXT} is text",
    "  leading and trailing spaces  \n\n\n",
]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A few stdlib sources, ~150 KB: real code and prose, with some non-ASCII in their docstrings.
STDLIB_FILES = ["textwrap.py", "shlex.py", "html/entities.py", "fractions.py", "difflib.py"]


@pytest.fixture(scope="module")
def stdlib_texts() -> list[str]:
    return [(STDLIB / name).read_text(encoding="utf-8") for name in STDLIB_FILES]


@pytest.fixture(scope="module")
def bpe(stdlib_texts):
    return train_bpe(iter(stdlib_texts), 600)


def test_byte_ids_are_the_utf8_bytes_and_round_trip_exactly():
    tokenizer = ByteTokenizer()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == list(text.encode("utf-8"))  # a reference by hand: the bytes themselves
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode_batch([text])[0].tolist() == ids
    assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.eot_id) == ("byte", 257, 256)


def test_byte_decode_renders_end_of_text_and_replaces_broken_utf8():
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([104, 105, 256, 111]) == f"hi{EOT_TEXT}o"
    assert tokenizer.decode(list("é".encode())[:1] + [33]) == "\ufffd!"  # a sample cut mid-character
    with pytest.raises(ValueError, match="token id 257 is outside the byte tokenizer's vocabulary of 257"):
        tokenizer.decode([1, 257])


def test_bpe_round_trips_real_text_and_unseen_text(bpe, stdlib_texts):
    assert (bpe.kind, bpe.vocab_size) == ("bpe", 600)
    for text in stdlib_texts + TEXTS:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        assert all(0 <= i < bpe.vocab_size for i in ids)
    # merges learned: far fewer ids than bytes on the text it was trained on
    assert len(bpe.encode(stdlib_texts[0])) < 0.6 * len(stdlib_texts[0].encode())


def test_bpe_never_encodes_the_marker_text_as_end_of_text(bpe):
    ids = bpe.encode(f"a{EOT_TEXT}b")
    assert bpe.eot_id not in ids
    assert bpe.decode([*bpe.encode("end"), bpe.eot_id]) == f"end{EOT_TEXT}"


def test_a_spec_loads_the_same_tokenizer(bpe, tmp_path):
    for tokenizer in (ByteTokenizer(), bpe):
        spec = json.loads(tokenizer.to_json())
        assert {key: spec[key] for key in ("kind", "vocab_size", "eot_id")} == {
            "kind": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id,
        }
        loaded = tokenizer_from_json(tokenizer.to_json())
        for text in TEXTS:
            assert loaded.encode(text) == tokenizer.encode(text)
        (tmp_path / TOKENIZER_FILE).write_text(tokenizer.to_json())
        assert read_tokenizer(str(tmp_path)).encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])
        assert read_tokenizer(str(tmp_path / TOKENIZER_FILE)).kind == tokenizer.kind
    assert "bpe" in json.loads(bpe.to_json())


def test_bad_specs_and_sizes_are_one_line(tmp_path):
    for spec, message in [
        ("{", "not JSON"),
        ('{"kind": "wordpiece"}', "kind must be one of byte, bpe, pretrained, got 'wordpiece'"),
        ('{"kind": "bpe"}', "no 'bpe' string"),
        ('{"kind": "byte", "vocab_size": 300}', "says vocab_size 300"),
    ]:
        with pytest.raises(ValueError, match=message):
            tokenizer_from_json(spec)
    with pytest.raises(ValueError, match="--vocab-size must be at least 257"):
        train_bpe(iter(["abc"]), 100)
    with pytest.raises(ValueError, match="no such tokenizer file"):
        read_tokenizer(str(tmp_path / "none.json"))


def test_without_the_tokenizers_library_bpe_names_the_extra_and_byte_works(monkeypatch, bpe):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    with pytest.raises(ValueError, match=r"--tokenizer bpe needs the tokenizers library: pip install 'raypar\[lm\]'"):
        train_bpe(iter(["abc"]), 300)
    with pytest.raises(ValueError, match=r"pip install 'raypar\[lm\]'"):
        tokenizer_from_json(bpe.to_json())
    assert tokenizer_from_json(ByteTokenizer().to_json()).encode("ok") == [111, 107]
