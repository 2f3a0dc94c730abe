"""Sampling text from a trained language model, in this process (no Ray): the model a run
directory or a weights file names, its tokenizer, and the sampling loop.

What is read: a run directory (``summary.json`` with ``"task": "lm"``, ``model.pt`` or
``best_model.pt``, ``tokenizer.json``), or a weights file: its model described by the
``summary.json`` beside it, else by ``--model`` and ``--model-option`` (built for the tokenizer's
vocabulary), and its tokenizer the ``tokenizer.json`` beside it, else ``--tokenizer``. The run's
record is checked and a user's model code runs only when named, as for predict (``trained``).

The context is the last ``block_size`` tokens: ``--block-size``, else the run's ``block_size``
(the data's T), else the model's ``block_size`` option as recorded or as its builder's default.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
import torch
from torch import nn

from models import model_factory
from models.lm import logits_of
from ray_jobs.core.pretrained import is_pretrained, trained_factory
from ray_jobs.data import storage
from ray_jobs.data.tokenizer import TOKENIZER_FILE, Tokenizer, read_tokenizer
from ray_jobs.predict.trained import WEIGHTS, TrainedModel, check_allowed, check_record, read_summary

SUMMARY_FILE = "summary.json"
LM_TASK = "lm"


@dataclass
class Sampling:
    """How each new token is drawn."""

    max_new_tokens: int = 200
    """Tokens to generate after the prompt."""
    temperature: float = 0.8
    """Logits are divided by it; 0 takes the most likely token (greedy, no draw)."""
    top_k: int | None = None
    """Draw among the k most likely tokens only; None: all."""
    seed: int = 0
    """Seeds the draws' ``torch.Generator``: the same seed, model and prompt give the same text."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens must be at least 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"--temperature must be at least 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"--top-k must be at least 1, got {self.top_k}")


@dataclass
class LanguageModel:
    """A loaded model, its tokenizer and the context length it samples with."""

    model: nn.Module
    tokenizer: Tokenizer
    block_size: int
    vocab_size: int
    """The model's output width: ids it may produce (those past the tokenizer's are never drawn)."""
    device: torch.device


def load_language_model(
    path: str,
    *,
    checkpoint: str = "final",
    model: str | None = None,
    model_options: dict[str, Any] | None = None,
    trust_model_code: bool = False,
    tokenizer: str | None = None,
    block_size: int | None = None,
    device: str = "cpu",
) -> LanguageModel:
    """The model at ``path`` (a run directory, or a weights file), checked before its code runs;
    ``ValueError`` in one line for anything missing or wrong."""
    if block_size is not None and block_size < 1:
        raise ValueError(f"--block-size must be at least 1, got {block_size}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here; use --device cpu")
    weights, run_dir = _weights(path, checkpoint)
    summary, record = _model_record(path, run_dir, weights is not None, model, model_options, trust_model_code)
    words = _tokenizer(tokenizer, run_dir, path)
    # a bare weights file's model is built for the tokenizer's vocabulary; a run's record has its own
    record = {"in_features": words.vocab_size, "out_features": words.vocab_size, **record}
    weights = weights or storage.join(run_dir, WEIGHTS[checkpoint])
    if not storage.exists(weights):
        hint = " (the run had no --val-data)" if checkpoint == "best" else ""
        raise ValueError(f"{path} has no {WEIGHTS[checkpoint]}{hint}")
    name = record["name"]
    factory = trained_factory(name, run_dir) if is_pretrained(name) else model_factory(name)
    loaded = _load(TrainedModel(record, LM_TASK, storage.locate(weights), factory), device, weights)
    context = block_size or _block_size(summary, record, factory, path)
    limit = record.get("block_size")
    if isinstance(limit, int) and context > limit:
        raise ValueError(f"--block-size {context} is longer than the model's block_size {limit} (positions it has)")
    return LanguageModel(loaded, words, context, record["out_features"], torch.device(device))


def _model_record(
    path: str,
    run_dir: str,
    bare: bool,
    model: str | None,
    model_options: dict[str, Any] | None,
    trust_model_code: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the run's summary, its model record): from the summary.json of the run, or for a weights
    file with none beside it, ``--model`` and its options (the widths left to the tokenizer)."""
    if storage.exists(storage.join(run_dir, SUMMARY_FILE)):
        summary = read_summary(run_dir)
        if summary.get("task") != LM_TASK:
            raise ValueError(
                f"{path} is not a language-model run (its task is {summary.get('task') or 'regression'}): generate "
                "samples from runs trained with --task lm"
            )
        record = check_record(summary.get("model"), run_dir)
        if model_options:
            raise ValueError(f"--model-option: {path}'s summary.json records its model's options already")
        check_allowed(record["name"], run_dir, model, trust_model_code)
        return summary, record
    if not bare:
        raise ValueError(f"{path} has no {SUMMARY_FILE}: not a finished raypar run (name its model.pt, with --model)")
    if model is None:
        raise ValueError(
            f"{path}: no {SUMMARY_FILE} beside it says which model it holds: name it with --model "
            "(and its --model-option values)"
        )
    return {}, {"name": model, **(model_options or {})}


def _weights(path: str, checkpoint: str) -> tuple[str | None, str]:
    """(the weights file when ``path`` names one, the directory to read the run's files from)."""
    filesystem, local = storage.resolve(path)
    if filesystem.get_file_info(local).type == pafs.FileType.File:
        if checkpoint != "final":
            raise ValueError(f"--checkpoint {checkpoint}: {path} is a weights file already")
        return path, storage.without_query(path).rsplit("/", 1)[0] if "://" in path else os.path.dirname(local)
    if filesystem.get_file_info(local).type == pafs.FileType.NotFound:
        raise ValueError(f"{path}: no such run directory or weights file")
    return None, path


def _tokenizer(flag: str | None, run_dir: str, path: str) -> Tokenizer:
    if flag is not None:
        try:
            return read_tokenizer(flag)
        except ValueError as error:
            raise ValueError(f"--tokenizer {error}") from None
    beside = storage.join(run_dir, TOKENIZER_FILE)
    if not storage.exists(beside):
        raise ValueError(
            f"{path}: no {TOKENIZER_FILE} in {storage.without_query(run_dir)}: name the data's with --tokenizer "
            "(python -m ray_jobs.data tokenize wrote it beside the Parquet files)"
        )
    return read_tokenizer(str(beside))


def _load(trained: TrainedModel, device: str, weights: str) -> nn.Module:
    try:
        return trained.load(torch.device(device))
    except RuntimeError as error:  # load_state_dict: the weights are not this model's
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        name = trained.record["name"]
        raise ValueError(f"{storage.without_query(weights)} does not fit the model {name}: {first}") from None


def _block_size(summary: dict[str, Any], record: dict[str, Any], factory, path: str) -> int:
    """The run's data context (``block_size`` in summary.json), else the model's own option."""
    for value in (summary.get("block_size"), record.get("block_size")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    try:
        default = inspect.signature(factory).parameters.get("block_size")
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        default = None
    if default is not None and isinstance(default.default, int):
        return default.default
    raise ValueError(f"{path}: neither the run nor its model says its context length: give --block-size")


def encode_prompt(lm: LanguageModel, prompt: str) -> list[int]:
    """The prompt's ids; an empty prompt starts a new document (end-of-text). Ids the model has no
    logits for are refused: the tokenizer is not this model's."""
    ids = lm.tokenizer.encode(prompt) if prompt else [lm.tokenizer.eot_id]
    beyond = [i for i in ids if i >= lm.vocab_size]
    if beyond:
        raise ValueError(
            f"--prompt encodes to token id {max(beyond)}, beyond the model's vocabulary of {lm.vocab_size}: "
            f"the {lm.tokenizer.kind} tokenizer (vocabulary {lm.tokenizer.vocab_size}) is not this model's"
        )
    return ids


@torch.no_grad()
def sample(lm: LanguageModel, ids: list[int], sampling: Sampling) -> list[int]:
    """``sampling.max_new_tokens`` ids after ``ids``, each from the logits of the last position
    over the last ``block_size`` tokens: divided by the temperature, cut to the top k, drawn with
    ``torch.multinomial`` from a generator seeded by ``sampling.seed`` (temperature 0: argmax)."""
    generator = torch.Generator(device=lm.device).manual_seed(sampling.seed)
    tokens = torch.tensor([ids], dtype=torch.int64, device=lm.device)
    usable = min(lm.vocab_size, lm.tokenizer.vocab_size)  # a vocabulary padded past the tokenizer's
    for _ in range(sampling.max_new_tokens):
        logits = logits_of(lm.model(tokens[:, -lm.block_size :]))[:, -1, :usable].float()
        if sampling.temperature == 0:
            following = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / sampling.temperature
            if sampling.top_k is not None and sampling.top_k < usable:
                kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            following = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, following], dim=1)
    return tokens[0, len(ids) :].tolist()


def generate(lm: LanguageModel, prompt: str, sampling: Sampling) -> str:
    """The prompt and the text sampled after it."""
    return prompt + lm.tokenizer.decode(sample(lm, encode_prompt(lm, prompt), sampling))
