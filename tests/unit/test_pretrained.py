"""``--model hf:DIR`` and ``--tokenizer DIR`` without Ray: a checkpoint's tokenizer writes the rows its
library encodes; the checkpoint loads whole to transformers' own weights; each bad input is one
line and leaves no run directory. Checkpoints are written here (tests/pretrained.py), never fetched."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from ray_jobs.core.config import TrainConfig
from ray_jobs.data.__main__ import main
from ray_jobs.data.tokenizer import VOCAB_SIZE_KEY, read_tokenizer
from ray_jobs.driver.prepare import prepare
from tests.helpers import write_tokens
from tests.pretrained import VOCAB, write_gpt2, write_llama, write_tokenizer

transformers = pytest.importorskip("transformers", reason="hf: needs transformers (pip install 'raypar[hf]')")

DOCS = ["def first():\n    return 1\n", "the second — with ü\n", "class Third:\n    pass\n" * 6]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2")
    write_gpt2(directory)
    write_tokenizer(directory)
    return str(directory)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_tokens(str(tmp_path_factory.mktemp("data") / "train.parquet"), rows=16, block_size=8)


def config(data, tmp_path, model, **changes) -> TrainConfig:
    return TrainConfig(
        data=data, storage_path=str(tmp_path), name="run", model=model, epochs=1, batch_size=8, **changes
    )


def test_the_checkpoints_tokenizer_writes_the_ids_its_library_encodes_joined_by_its_eos(gpt2, tmp_path, capsys):
    from tokenizers import Tokenizer

    (tmp_path / "in").mkdir()
    for index, text in enumerate(DOCS):
        (tmp_path / "in" / f"doc{index}.txt").write_text(text)
    block = 5
    code = main(["tokenize", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
                 "--block-size", str(block), "--tokenizer", gpt2])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    library = Tokenizer.from_file(f"{gpt2}/tokenizer.json")
    eos = library.token_to_id("<|endoftext|>")
    stream = [i for text in DOCS for i in [*library.encode(text, add_special_tokens=False).ids, eos]]
    rows = pq.read_table(tmp_path / "out" / "train.parquet").column("tokens").to_pylist()
    assert rows == [stream[i * block : i * block + block + 1] for i in range((len(stream) - 1) // block)]
    tokenizer = read_tokenizer(str(tmp_path / "out"))
    assert (tokenizer.kind, tokenizer.eot_id, tokenizer.vocab_size) == ("pretrained", eos, library.get_vocab_size())
    assert (
        pq.read_schema(tmp_path / "out" / "train.parquet").metadata[VOCAB_SIZE_KEY]
        == str(tokenizer.vocab_size).encode()
    )
    assert tokenizer.decode(rows[0]) == library.decode(rows[0], skip_special_tokens=False)


@pytest.mark.parametrize("write", [write_gpt2, write_llama], ids=["gpt2", "llama"])
def test_the_starting_weights_are_the_checkpoints_as_transformers_loads_them(write, data, tmp_path):
    directory = write(tmp_path / "ckpt")
    prepared = prepare(config(data, tmp_path, f"hf:{directory}"), "ddp")
    expected = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert prepared.initial_state.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(prepared.initial_state[name], tensor, rtol=0, atol=0, msg=name)


def test_fsdp_is_handed_the_headers_not_the_weights(gpt2, data, tmp_path):
    prepared = prepare(config(data, tmp_path, f"hf:{gpt2}"), "fsdp")
    slices = prepared.initial_state
    assert not isinstance(slices, dict)
    # The tied head is read through the embedding's name; every other tensor under its own.
    assert slices.names.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert set(slices.names.files.values()) == set(slices.weights.tensors)


def broken(directory, how: str) -> str:
    """A checkpoint spoiled one way."""
    weights = directory / "model.safetensors"
    config_file = directory / "config.json"
    if how == "no config.json":
        config_file.unlink()
    elif how == "not a causal LM":
        config_file.write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "corrupt":
        data = bytearray(weights.read_bytes())
        data[8:40] = b"\xff" * 32
        weights.write_bytes(bytes(data))
    elif how == "missing":
        weights.unlink()
    elif how == "names":
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "n_layer": 3}))
    elif how == "shapes":
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "n_positions": 32}))
    return str(directory)


@pytest.mark.parametrize(
    "how, says",
    [
        ("no config.json", "no config.json"),
        ("not a causal LM", "not a causal language model"),
        ("truncated", "is truncated"),
        ("corrupt", "is corrupt"),
        ("missing", "no model.safetensors"),
        ("names", "missing transformer.h.2"),
        ("shapes", re.escape("transformer.wpe.weight is [16, 16] in the file, [32, 16] in the model")),
    ],
)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_broken_checkpoint_is_one_line_and_nothing_is_written(data, tmp_path, how, says, strategy):
    directory = broken(tmp_path / "ckpt", how) if write_gpt2(tmp_path / "ckpt") else None
    with pytest.raises(ValueError, match=says) as error:
        prepare(config(data, tmp_path, f"hf:{directory}"), strategy)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


def test_a_hub_id_says_how_to_fetch_it_first(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"downloads nothing.*hf download gpt2 --local-dir DIR"):
        prepare(config(data, tmp_path, "hf:gpt2"), "ddp")


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(gpt2, tmp_path):
    data = write_tokens(str(tmp_path / "wide.parquet"), rows=16, block_size=8, vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match=rf"has {VOCAB + 1} ids, the model's vocabulary only {VOCAB}"):
        prepare(config(data, tmp_path, f"hf:{gpt2}"), "ddp")
    assert not (tmp_path / "run").exists()


def test_without_the_extra_hf_is_one_line_naming_it(gpt2, data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ValueError, match=r"raypar\[hf\]"):
        prepare(config(data, tmp_path, f"hf:{gpt2}"), "ddp")


def test_init_from_takes_a_runs_safetensors(gpt2, data, tmp_path):
    from safetensors.torch import save_file

    state = transformers.AutoModelForCausalLM.from_pretrained(gpt2).state_dict()
    changed = {name: tensor + 1 for name, tensor in state.items() if name != "lm_head.weight"}
    save_file(changed, str(tmp_path / "model.safetensors"))
    prepared = prepare(config(data, tmp_path, f"hf:{gpt2}", init_from=str(tmp_path / "model.safetensors")), "ddp")
    torch.testing.assert_close(prepared.initial_state["lm_head.weight"], changed["transformer.wte.weight"])


def test_a_checkpoint_in_a_bucket_loads_whole_and_by_its_headers(gpt2, data, tmp_path, s3_endpoint):
    """hf:s3://...: ddp's driver reads the weights through storage, fsdp's the headers only (ranged
    reads); the workers' slices are read from a local copy (``storage.local_directory``), here whole."""
    import uuid

    import pyarrow.fs as pafs

    from ray_jobs.data import storage
    from ray_jobs.data.storage import local_directory
    from ray_jobs.data_parallel.sharding import read_slices

    bucket = f"raypar-{uuid.uuid4().hex[:8]}"
    pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http", allow_bucket_creation=True).create_dir(bucket)
    uri = f"s3://{bucket}/gpt2?endpoint_override={s3_endpoint}&scheme=http"
    for path in sorted(Path(gpt2).iterdir()):
        storage.write_bytes(storage.join(uri, path.name), path.read_bytes())
    expected = transformers.AutoModelForCausalLM.from_pretrained(gpt2).state_dict()
    whole = prepare(config(data, tmp_path / "a", f"hf:{uri}"), "ddp").initial_state
    assert all(torch.equal(whole[name], tensor) for name, tensor in expected.items())
    slices = prepare(config(data, tmp_path / "b", f"hf:{uri}"), "fsdp").initial_state
    filled = {name: torch.empty_like(tensor) for name, tensor in expected.items() if name != "lm_head.weight"}
    with local_directory(slices.weights.directory) as local:
        read_slices(filled, slices, local)
    assert all(torch.equal(filled[name], expected[name]) for name in filled)


def test_a_worker_that_cannot_see_the_weights_says_where_they_must_be(gpt2, data, tmp_path):
    from ray_jobs.data_parallel.sharding import read_slices

    slices = prepare(config(data, tmp_path, f"hf:{gpt2}"), "fsdp").initial_state
    state = {"transformer.wte.weight": torch.empty(VOCAB, 16)}
    with pytest.raises(ValueError, match=r"is not on node .*: under fsdp every worker reads the starting weights"):
        read_slices(state, slices, str(tmp_path / "elsewhere"))
