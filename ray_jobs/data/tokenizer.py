"""Tokenizers for language-model data: text to token ids and back, and the spec that travels with
the ids (in the Parquet schema metadata, in ``tokenizer.json`` beside the data and in a run directory).

Two kinds, one contract (``Tokenizer``): ``byte`` (the UTF-8 bytes 0..255 and end-of-text 256; no
dependency) and ``bpe`` (a byte-level BPE trained on the user's own text with the ``tokenizers``
library, an optional extra: ``pip install 'raypar[lm]'``; never downloaded from a hub). Both are
exact: ``decode(encode(text)) == text`` for every string of valid Unicode, and both render the
end-of-text id as the visible marker ``<|endoftext|>`` when decoding (so a sample shows where the
model ended a document). ``encode`` never yields end-of-text for text that merely spells the marker:
only the tokenizing job puts it between documents.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ray_jobs.data import storage

# Defined once, where the training data is read: TOKENIZER_KEY (the spec JSON) and VOCAB_SIZE_KEY
# (str(vocab_size) bytes) in the Parquet schema metadata, the one column of token ids, and
# TOKENIZER_FILE, the spec's file name beside the data and in an lm run's directory.
from ray_jobs.data.parquet import TOKENIZER_FILE, TOKENIZER_KEY, TOKENS_COLUMN, VOCAB_SIZE_KEY

__all__ = [
    "EOT_TEXT",
    "TOKENIZER_FILE",
    "TOKENIZER_KEY",
    "TOKENS_COLUMN",
    "VOCAB_SIZE_KEY",
    "BpeTokenizer",
    "PretrainedTokenizer",
    "ByteTokenizer",
    "Tokenizer",
    "read_pretrained_tokenizer",
    "read_tokenizer",
    "schema_metadata",
    "tokenizer_from_json",
    "train_bpe",
]

EOT_TEXT = "<|endoftext|>"
KINDS = ("byte", "bpe")  # what --tokenizer trains or builds; "pretrained" is read from a file
SPEC_KINDS = (*KINDS, "pretrained")
# A checkpoint's end-of-text, when no file of it names its eos: the spellings the common families use.
EOS_SPELLINGS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
BYTE_VOCAB = 257  # 256 byte values and end-of-text
# The most ids a token column holds: it is list<int32>.
MAX_VOCAB = 2**31 - 1
LM_EXTRA = "pip install 'raypar[lm]'"


class Tokenizer:
    """Text to token ids and back. ``kind`` is ``byte`` or ``bpe``; ids lie in ``[0, vocab_size)``;
    ``eot_id`` ends each document in the tokenized stream."""

    kind: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eot_id": self.eot_id}

    def to_json(self) -> str:
        """The spec: ``{"kind", "vocab_size", "eot_id"}``, and for bpe ``"bpe"``: the tokenizers
        library's own JSON, as a string."""
        return json.dumps(self.spec())

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids as an int32 array: what the tokenizing job calls, in batches."""
        return [np.asarray(self.encode(text), dtype=np.int32) for text in texts]

    def check_ids(self, ids: Sequence[int]) -> None:
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the {self.kind} tokenizer's vocabulary of {self.vocab_size}")


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text, one id each (0..255); end-of-text is 256. Decoding renders 256
    as ``<|endoftext|>`` and replaces bytes that are not valid UTF-8 (a sample cut mid-character)
    with U+FFFD."""

    kind = "byte"
    vocab_size = BYTE_VOCAB
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        self.check_ids(ids)
        marker = EOT_TEXT.encode()
        return b"".join(marker if i == self.eot_id else bytes((i,)) for i in ids).decode("utf-8", errors="replace")


class BpeTokenizer(Tokenizer):
    """A byte-level BPE of the ``tokenizers`` library (GPT-2's pre-tokenizer, no normalizer, so
    every string round-trips), with ``<|endoftext|>`` as its one special token."""

    kind = "bpe"

    def __init__(self, library_json: str, eot_id: int | None = None) -> None:
        module = _tokenizers()
        self.inner = module.Tokenizer.from_str(library_json)
        # Text that spells the marker is text: only the job's joins are end-of-text. (Not kept in
        # the library's JSON, so set on every load.)
        self.inner.encode_special_tokens = True
        eot_id = self.inner.token_to_id(EOT_TEXT) if eot_id is None else eot_id
        if eot_id is None:
            raise ValueError(f"the bpe tokenizer has no {EOT_TEXT} token")
        self.vocab_size, self.eot_id = self.inner.get_vocab_size(), eot_id
        if not 0 <= eot_id < self.vocab_size:
            raise ValueError(f"end-of-text id {eot_id} is outside the vocabulary of {self.vocab_size}")

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # The library encodes a batch on all cores.
        encodings = self.inner.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int32) for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        self.check_ids(ids)
        return self.inner.decode(ids, skip_special_tokens=False)

    def spec(self) -> dict[str, Any]:
        return {**super().spec(), "bpe": self.inner.to_str()}


class PretrainedTokenizer(BpeTokenizer):
    """A checkpoint's own tokenizer (its ``tokenizer.json``, the ``tokenizers`` library's), so the ids
    are the ones its model was trained on; its end-of-text token (the checkpoint's ``eos``) joins
    documents. Nothing is added: no BOS, no template."""

    kind = "pretrained"


def _tokenizers():
    """The ``tokenizers`` library, imported only when a bpe tokenizer is asked for."""
    try:
        import tokenizers
    except ImportError:
        raise ValueError(f"--tokenizer bpe needs the tokenizers library: {LM_EXTRA}") from None
    return tokenizers


def check_vocab_size(vocab_size: int) -> None:
    if not BYTE_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(
            f"--vocab-size must be at least {BYTE_VOCAB} (the 256 bytes and end-of-text) and at most {MAX_VOCAB} "
            f"(ids are int32), got {vocab_size}"
        )


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` ids trained on ``texts`` here, in one pass that
    keeps word counts, not the texts. Its vocabulary is smaller when the text has fewer merges to
    learn: ``vocab_size`` of the result says what it has."""
    check_vocab_size(vocab_size)
    module = _tokenizers()
    inner = module.Tokenizer(module.models.BPE())
    inner.pre_tokenizer = module.pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = module.decoders.ByteLevel()
    trainer = module.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=module.pre_tokenizers.ByteLevel.alphabet(),  # every byte, seen or not
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer)
    return BpeTokenizer(inner.to_str())


def tokenizer_from_json(text: str | bytes) -> Tokenizer:
    """The tokenizer a spec (``to_json``) describes; ``ValueError`` says what is wrong with it."""
    try:
        spec = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"the tokenizer spec is not JSON ({error})") from None
    if not isinstance(spec, dict) or spec.get("kind") not in SPEC_KINDS:
        kind = spec.get("kind") if isinstance(spec, dict) else None
        raise ValueError(f"the tokenizer spec's kind must be one of {', '.join(SPEC_KINDS)}, got {kind!r}")
    if spec["kind"] == "byte":
        tokenizer: Tokenizer = ByteTokenizer()
    elif not isinstance(spec.get("bpe"), str):
        raise ValueError("the bpe tokenizer spec has no 'bpe' string (the tokenizers library's JSON)")
    else:
        try:
            kind = PretrainedTokenizer if spec["kind"] == "pretrained" else BpeTokenizer
            tokenizer = kind(spec["bpe"], spec.get("eot_id") if spec["kind"] == "pretrained" else None)
        except Exception as error:  # the library's own parse error, whatever its type
            if isinstance(error, ValueError) and LM_EXTRA in str(error):
                raise
            raise ValueError(f"the bpe tokenizer spec does not load: {str(error).splitlines()[0]}") from None
    for key in ("vocab_size", "eot_id"):
        if key in spec and spec[key] != getattr(tokenizer, key):
            raise ValueError(
                f"the tokenizer spec says {key} {spec[key]!r}, its {spec['kind']} tokenizer has "
                f"{getattr(tokenizer, key)}"
            )
    return tokenizer


def read_tokenizer(path_or_dir: str) -> Tokenizer:
    """The tokenizer in a ``tokenizer.json`` file, or in the one a directory holds (local or a URI)."""
    target = path_or_dir
    if storage.list_dir(path_or_dir):  # a directory (an empty one has nothing to read either way)
        target = storage.join(path_or_dir, TOKENIZER_FILE)
    try:
        text = storage.read_bytes(target)
    except FileNotFoundError:
        raise ValueError(f"{storage.without_query(str(target))}: no such tokenizer file") from None
    try:
        return tokenizer_from_json(text)
    except ValueError as error:
        raise ValueError(f"{storage.without_query(str(target))}: {error}") from None


def read_pretrained_tokenizer(path: str) -> Tokenizer:
    """``--tokenizer DIR|tokenizer.json``: a checkpoint's tokenizer (the ``tokenizers`` library's JSON),
    its end-of-text the checkpoint's ``eos`` (from ``tokenizer_config.json``, ``config.json`` or
    ``generation_config.json`` beside it); or a raypar dataset's ``tokenizer.json``, reused."""
    directory, target = path, storage.join(path, TOKENIZER_FILE)
    if path.endswith(".json"):
        directory, target = path.rpartition("/")[0] or ".", path
    elif not storage.list_dir(path):
        raise ValueError(
            f"--tokenizer {path!r} is unknown: not {' or '.join(KINDS)}, nor a directory or a tokenizer.json "
            "(a pretrained model's tokenizer, fetched beforehand: raypar downloads nothing)"
        )
    try:
        text = storage.read_bytes(target)
    except FileNotFoundError:
        what = "no such file" if path.endswith(".json") else f"no {TOKENIZER_FILE} in it"
        raise ValueError(f"--tokenizer {path}: {what} (byte, bpe, or a checkpoint's tokenizer)") from None
    try:
        library = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--tokenizer {path}: {TOKENIZER_FILE} is not JSON ({error})") from None
    if isinstance(library, dict) and "kind" in library:  # raypar's own spec: another dataset's tokenizer
        return read_tokenizer(str(target))
    module = _tokenizers()
    try:
        inner = module.Tokenizer.from_str(text.decode())
    except Exception as error:  # the library's own parse error, whatever its type
        raise ValueError(f"--tokenizer {path}: not a tokenizers library file ({str(error).splitlines()[0]})") from None
    eot_id = _eos_id(directory, inner)
    if eot_id is None:
        raise ValueError(
            f"--tokenizer {path}: no end-of-text token to join documents with (no eos in tokenizer_config.json, "
            f"config.json or generation_config.json, and none of {', '.join(EOS_SPELLINGS)} in its vocabulary)"
        )
    return PretrainedTokenizer(text.decode(), eot_id)


def _eos_id(directory: str, inner) -> int | None:
    """The checkpoint's end-of-text id: named by its files, else a common spelling in the vocabulary."""
    for name, key in (("tokenizer_config.json", "eos_token"), ("config.json", "eos_token_id"),
                      ("generation_config.json", "eos_token_id")):  # fmt: skip
        try:
            value = json.loads(storage.read_bytes(storage.join(directory, name))).get(key)
        except (FileNotFoundError, ValueError, AttributeError):
            continue
        value = value[0] if isinstance(value, list) and value else value
        value = value.get("content") if isinstance(value, dict) else value
        found = inner.token_to_id(value) if isinstance(value, str) else value
        if isinstance(found, int):
            return found
    return next((inner.token_to_id(text) for text in EOS_SPELLINGS if inner.token_to_id(text) is not None), None)


def schema_metadata(tokenizer: Tokenizer) -> dict[bytes, bytes]:
    """What a token file's schema carries: the spec and the vocabulary size."""
    return {TOKENIZER_KEY: tokenizer.to_json().encode(), VOCAB_SIZE_KEY: str(tokenizer.vocab_size).encode()}
