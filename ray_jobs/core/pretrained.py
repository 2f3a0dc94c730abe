"""A Hugging Face checkpoint as a run's model and starting weights (``--model hf:DIR``), and weights in
safetensors files (``--init-from``, ``model.safetensors``).

What the driver reads of a checkpoint is its ``config.json`` and each safetensors file's header
(names, dtypes, shapes, offsets): enough to build the architecture, to check every tensor against
it, and to refuse a truncated file, without reading a weight. Who reads the weights, and how much
of them, is the strategy's: ddp, dp and the pipeline the whole state on the driver, fsdp each
worker its own slices (``data_parallel.sharding``).

``transformers`` and ``safetensors`` are the ``raypar[hf]`` extra, imported only here and only
when asked for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ray_jobs.data import storage

PREFIX = "hf:"
HF_EXTRA = "pip install 'raypar[hf]'"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A safetensors header is a little-endian u64 length, then that much JSON; a longer one is corrupt.
MAX_HEADER_BYTES = 100 * 2**20
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def is_pretrained(name: str) -> bool:
    return name.startswith(PREFIX)


def hf_modules():
    """``transformers`` (and with it ``safetensors``), or one line naming the extra."""
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError:
        raise ValueError(f"--model hf:DIR needs transformers and safetensors: {HF_EXTRA}") from None
    return transformers


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    """Where its bytes begin in the file (row-major, contiguous): a slice of rows is one range."""


@dataclass(frozen=True)
class Weights:
    """Safetensors files in one directory, known by their headers: ``tensors`` by name."""

    directory: str
    tensors: dict[str, TensorInfo]

    @property
    def files(self) -> list[str]:
        return sorted({info.file for info in self.tensors.values()})

    @property
    def num_bytes(self) -> int:
        return sum(
            torch.Size(info.shape).numel() * DTYPES[info.dtype].itemsize
            for info in self.tensors.values()
            if info.dtype in DTYPES
        )


def read_weights(directory: str, files: list[str], what: str) -> Weights:
    """The headers of ``files`` in ``directory``; ``ValueError`` (``what`` names the input) for a
    missing, truncated or corrupt file."""
    sizes = storage.file_sizes(directory)
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        if name not in sizes:
            raise ValueError(f"{what}: {name} is missing")
        start, header = _header(storage.join(directory, name), sizes[name], f"{what}: {name}")
        for key, info in header.items():
            if key in tensors:
                raise ValueError(f"{what}: tensor {key} is in both {tensors[key].file} and {name}")
            tensors[key] = TensorInfo(name, info["dtype"], tuple(info["shape"]), start + info["data_offsets"][0])
    return Weights(storage.absolute(directory) if isinstance(directory, str) else directory, tensors)


def _header(target: storage.Target, size: int, what: str) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data begins, and its tensor entries, checked against its size."""
    if size < 8:
        raise ValueError(f"{what} is truncated ({size} bytes): not a safetensors file")
    (length,) = struct.unpack("<Q", storage.read_range(target, 0, 8))
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise ValueError(f"{what} is truncated or corrupt: its header claims {length} bytes, the file has {size}")
    try:
        header = json.loads(storage.read_range(target, 8, length))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{what} is corrupt: its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{what} is corrupt: its header is not a table of tensors")
    header.pop("__metadata__", None)
    data = size - 8 - length
    for key, info in header.items():
        try:
            begin, end = info["data_offsets"]
            count = torch.Size(info["shape"]).numel()
            expected = count * DTYPES[info["dtype"]].itemsize if info["dtype"] in DTYPES else end - begin
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{what} is corrupt: tensor {key}'s entry is {info!r}") from None
        if end > data:
            raise ValueError(f"{what} is truncated: tensor {key} ends at byte {end} of {data} in the file")
        if end - begin != expected:
            raise ValueError(f"{what} is corrupt: tensor {key} holds {end - begin} bytes, its shape needs {expected}")
    return 8 + length, header


def read_config(directory: str) -> dict[str, Any]:
    """``--model hf:DIR``'s ``config.json``, with the checkpoint's safetensors files named (by its
    index or its listing; their headers are read where the weights are: ``read_source``):
    ``ValueError`` in one line for a hub id or a directory without ``config.json`` or safetensors."""
    what = f"--model hf:{directory}"
    entries = storage.file_sizes(directory)
    if not entries:
        if "://" not in directory and not os.path.isabs(directory) and not directory.startswith("."):
            raise ValueError(
                f"{what}: no such directory. raypar downloads nothing while it runs: fetch the checkpoint first "
                f"(hf download {directory} --local-dir DIR) and give --model hf:DIR"
            )
        raise ValueError(f"{what}: no such directory, or it is empty")
    if CONFIG_FILE not in entries:
        raise ValueError(f"{what}: no {CONFIG_FILE}; a Hugging Face checkpoint directory has one (save_pretrained)")
    try:
        config = json.loads(storage.read_bytes(storage.join(directory, CONFIG_FILE)))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{what}: {CONFIG_FILE} is not JSON ({error})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(f"{what}: {CONFIG_FILE} has no model_type, so no architecture to build")
    weight_files(directory, what)
    return config


def weight_files(directory: str, what: str) -> list[str]:
    """The safetensors files of a checkpoint directory: its index's, or ``model.safetensors``."""
    entries = storage.file_sizes(directory)
    if INDEX_FILE in entries:
        try:
            index = json.loads(storage.read_bytes(storage.join(directory, INDEX_FILE)))
            return sorted(set(index["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{what}: {INDEX_FILE} is not an index of safetensors shards (no weight_map)") from None
    if WEIGHTS_FILE in entries:
        return [WEIGHTS_FILE]
    found = sorted(name for name in entries if name.endswith(".safetensors"))
    if found:
        return found
    legacy = [name for name in entries if name.endswith((".bin", ".pt", ".pth"))]
    extra = f" (it has {', '.join(legacy)}: save it again with save_pretrained, which writes safetensors)"
    extra = extra if legacy else ""
    raise ValueError(f"{what}: no {WEIGHTS_FILE} or {INDEX_FILE}{extra}")


class PretrainedModel:
    """``--model hf:DIR``'s callable: the checkpoint's causal LM built from its ``config.json``, each
    option a config key set (``--model-option resid_pdrop=0``). Its weights are loaded apart."""

    def __init__(self, directory: str, config: dict[str, Any]) -> None:
        self.directory, self.config = directory, config

    def model_config(self, options: dict[str, Any]):
        transformers = hf_modules()
        values = {**self.config, "use_cache": False}  # training returns logits only
        try:
            config = transformers.AutoConfig.for_model(**values)
        except (ValueError, KeyError) as error:
            raise ValueError(f"--model hf:{self.directory}: {CONFIG_FILE}: {str(error).splitlines()[0]}") from None
        for key, value in options.items():
            if not hasattr(config, key):
                raise ValueError(f"--model-option {key}=...: the {config.model_type} config has no key {key!r}")
            setattr(config, key, value)
        return config

    def __call__(self, in_features: int, out_features: int, **options: Any) -> nn.Module:
        transformers = hf_modules()
        config = self.model_config(options)
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and in_features > vocab:
            raise ValueError(
                f"the data's tokenizer has {in_features} ids, the model's vocabulary only {vocab}: tokenize "
                f"with the checkpoint's own tokenizer (python -m ray_jobs.data tokenize --tokenizer {self.directory})"
            )
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError as error:
            if "Unrecognized configuration class" in str(error):
                architectures = ", ".join(self.config.get("architectures") or [config.model_type])
                raise ValueError(
                    f"--model hf:{self.directory} is a {architectures}, not a causal language model "
                    "(AutoModelForCausalLM has no class for it)"
                ) from None
            raise


def pretrained_factory(name: str) -> PretrainedModel:
    hf_modules()
    directory = name[len(PREFIX) :]
    return PretrainedModel(storage.absolute(directory), read_config(directory))


def trained_factory(name: str, run_dir: str) -> PretrainedModel:
    """A finished ``hf:`` run's model, from the ``hf/`` it wrote (the checkpoint it started from may
    be gone); ``name``'s checkpoint when the run has none."""
    exported = storage.join(run_dir, "hf", CONFIG_FILE)
    if not storage.exists(exported):
        return pretrained_factory(name)
    hf_modules()
    return PretrainedModel(str(storage.join(run_dir, "hf")), json.loads(storage.read_bytes(exported)))


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build a model whose parameters are on the meta device (no memory, no init) while its buffers
    are real: a rotary embedding's ``inv_freq``, computed in ``__init__``, is never in a checkpoint.
    A parameter assigned again (a tied head) stays the one object, so ties hold."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@dataclass(frozen=True)
class NameMap:
    """How a model's ``state_dict`` names meet a file's: ``files[model_name]`` is the file's name for
    it; ``aliases[model_name]`` another model name holding the same tensor (a tied head)."""

    files: dict[str, str]
    aliases: dict[str, str]


def match_names(model: nn.Module, weights: Weights, what: str) -> NameMap:
    """Every tensor of ``model``'s ``state_dict`` found in ``weights`` with its shape (a name may lack
    the base model's prefix, as old checkpoints' do; a tied tensor is found under any of its names),
    or ``ValueError`` listing what is missing, unexpected or of another shape."""
    state = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", "") + "."
    by_id: dict[int, list[str]] = {}
    for key, value in state.items():
        by_id.setdefault(id(value), []).append(key)
    files, aliases, missing, shapes = {}, {}, [], []
    for names in by_id.values():
        candidates = [(name, file) for name in names for file in (name, name.removeprefix(prefix))]
        found = [(name, file) for name, file in candidates if file in weights.tensors]
        if not found:
            missing.append(names[0])
            continue
        owner, file = found[0]
        files[owner] = file
        aliases.update({name: owner for name in names if name != owner})
        if weights.tensors[file].shape != tuple(state[owner].shape):
            shapes.append(
                f"{file} is {list(weights.tensors[file].shape)} in the file, {list(state[owner].shape)} in the model"
            )
    unexpected = sorted(set(weights.tensors) - set(files.values()) - set(_ignored(model, weights)))
    problems = [
        _listed("missing", missing),
        _listed("unexpected", unexpected),
        _listed("of another shape:", shapes),
    ]
    problems = [problem for problem in problems if problem]
    if problems:
        raise ValueError(f"{what}: the tensors do not match the model its config describes: {'; '.join(problems)}")
    return NameMap(files, aliases)


def _ignored(model: nn.Module, weights: Weights) -> list[str]:
    """Tensors a checkpoint may carry that its model does not load (old GPT-2's attention masks)."""
    patterns = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    return [name for name in weights.tensors if any(re.search(pattern, name) for pattern in patterns)]


def _listed(what: str, names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{what} {shown}"


def read_state(weights: Weights, names: NameMap) -> dict[str, torch.Tensor]:
    """The whole ``state_dict`` in the model's names (aliases included), read file by file."""
    from safetensors.torch import load

    by_file: dict[str, dict[str, str]] = {}
    for model_name, file_name in names.files.items():
        by_file.setdefault(weights.tensors[file_name].file, {})[file_name] = model_name
    state = {}
    for file, wanted in by_file.items():
        tensors = load(storage.read_bytes(storage.join(weights.directory, file)))
        state.update({model_name: tensors[file_name] for file_name, model_name in wanted.items()})
    state.update({alias: state[owner] for alias, owner in names.aliases.items()})
    return state


def read_source(directory: str, files: list[str] | None, what: str) -> Weights:
    """The headers of ``files`` in ``directory``, or of the directory's ``weight_files``."""
    return read_weights(directory, files or weight_files(directory, what), what)


def load_pretrained(model: nn.Module, directory: str, files: list[str] | None, what: str) -> None:
    """Load the weights of safetensors ``files`` (None: the directory's) into ``model``, whole."""
    weights = read_source(directory, files, what)
    state = read_state(weights, match_names(model, weights, what))
    model.load_state_dict(state)


# A run's hf/ splits its weights into files of at most this many bytes, with an index, as save_pretrained does.
MAX_SHARD_BYTES = 5 * 2**30
# What a checkpoint's tokenizer is made of, copied into a run's hf/ beside the weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


def untied(state: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """``state`` without a tied tensor's second name (GPT-2's ``lm_head.weight``): safetensors holds
    a tensor once, and a loader ties it back."""
    return {
        name: tensor.contiguous()
        for name, tensor in state.items()
        if not (name in aliases and torch.equal(tensor, state[aliases[name]]))
    }


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each second name of a tensor ``model`` holds under several, with its first."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        aliases.update({name: first[id(tensor)]} if id(tensor) in first else {})
        first.setdefault(id(tensor), name)
    return aliases


def safetensors_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """One safetensors file of ``state`` (untied, contiguous), marked as PyTorch's as transformers expects."""
    from safetensors.torch import save

    return save(state, metadata={"format": "pt"})


def file_indices(sizes: dict[str, int], max_bytes: int = MAX_SHARD_BYTES) -> dict[str, int]:
    """Which file (1 to n) each tensor of ``sizes`` (bytes, in order) goes to: the next one past ``max_bytes``."""
    indices, index, size = {}, 1, 0
    for name, nbytes in sizes.items():
        if size and size + nbytes > max_bytes:
            index, size = index + 1, 0
        indices[name] = index
        size += nbytes
    return indices


def sharded_names(num_files: int) -> list[str]:
    """The files of a checkpoint in ``num_files`` parts, as transformers names them."""
    return (
        [WEIGHTS_FILE]
        if num_files == 1
        else [f"model-{i:05d}-of-{num_files:05d}.safetensors" for i in range(1, num_files + 1)]
    )


def safetensors_files(state: dict[str, torch.Tensor], max_bytes: int = MAX_SHARD_BYTES) -> dict[str, bytes]:
    """``state`` as safetensors files by name: ``model.safetensors``, or past ``max_bytes``
    ``model-0000i-of-0000n.safetensors`` and their ``model.safetensors.index.json``."""
    indices = file_indices({name: t.numel() * t.element_size() for name, t in state.items()}, max_bytes)
    names = sharded_names(max(indices.values(), default=1))
    groups: list[dict[str, torch.Tensor]] = [{} for _ in names]
    for name, tensor in state.items():
        groups[indices[name] - 1][name] = tensor
    files = {file: safetensors_bytes(group) for file, group in zip(names, groups)}
    if len(names) == 1:
        return files
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": {name: names[i - 1] for name, i in indices.items()}}
    return {**files, INDEX_FILE: json.dumps(index, indent=2).encode()}


def mapped_tensors(path: str) -> dict[str, torch.Tensor]:
    """A local safetensors file's tensors, each mapped from the file (copy on write), not read: pages
    are read as they are used, and are the page cache's to drop, not this process's memory."""
    weights = read_weights(os.path.dirname(path) or ".", [os.path.basename(path)], path)
    tensors = {}
    for name, info in weights.tensors.items():
        dtype = DTYPES[info.dtype]
        count = torch.Size(info.shape).numel()
        if count == 0:
            tensors[name] = torch.empty(info.shape, dtype=dtype)
            continue
        raw = np.memmap(path, dtype=np.uint8, mode="c", offset=info.offset, shape=(count * dtype.itemsize,))
        tensors[name] = torch.from_numpy(raw).view(dtype).view(info.shape)
    return tensors
