"""fsdp's final weights leave as slices and come back whole, without Ray: two gloo processes shard a
tied GPT-2 and write their last checkpoint's ``weights/`` as the workers do; the driver's
consolidation then writes ``model.pt``, ``model.safetensors`` and ``hf/`` equal to the unsharded
weights, and refuses slices with a rank's file missing."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp

from ray_jobs.core.checkpoint import WEIGHTS_DIR, TrainState, checkpoint_name
from ray_jobs.driver.export import write_sliced_weights
from tests.pretrained import write_gpt2

transformers = pytest.importorskip("transformers", reason="hf: needs transformers (pip install 'raypar[hf]')")

NUM_RANKS = 2


def _rank(rank: int, checkpoint: str, out: str, port: int) -> None:
    import torch.distributed as dist

    from ray_jobs.data_parallel.sharding import Shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=NUM_RANKS)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    wrap = Shards()
    wrapped = wrap.wrap(model, torch.device("cpu"), "fp32")
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    os.makedirs(f"{out}/rank{rank}")
    wrap.write_shards(f"{out}/rank{rank}", wrapped, optimizer, final=True)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    """A run directory whose last checkpoint holds both ranks' slices, as Ray Train uploads them."""
    from tests.helpers import closed_port

    root = tmp_path_factory.mktemp("export")
    checkpoint = write_gpt2(root / "gpt2")
    mp.spawn(_rank, args=(checkpoint, str(root / "ranks"), closed_port()), nprocs=NUM_RANKS)
    weights = root / "run" / checkpoint_name(1) / WEIGHTS_DIR
    weights.mkdir(parents=True)
    for rank in range(NUM_RANKS):
        for name in os.listdir(root / "ranks" / f"rank{rank}" / WEIGHTS_DIR):
            shutil.copy(root / "ranks" / f"rank{rank}" / WEIGHTS_DIR / name, weights)
    return checkpoint, root / "run"


def test_each_ranks_slices_consolidate_into_the_whole_weights(sliced):
    from safetensors.torch import load_file

    checkpoint, run = sliced
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    expected = model.state_dict()
    assert len(os.listdir(run / checkpoint_name(1) / WEIGHTS_DIR)) == NUM_RANKS  # one file per rank
    export = write_sliced_weights(
        str(run), TrainState({}, {}, 1, weights_sliced=True), model, lambda dtype: {"config.json": b"{}"}
    )
    pickled = torch.load(run / "model.pt")
    assert pickled.keys() == expected.keys()
    saved = load_file(run / "model.safetensors")
    assert set(saved) == set(expected) - {"lm_head.weight"}  # the tied head once, as transformers saves it
    for name, tensor in expected.items():
        assert torch.equal(pickled[name], tensor), name
        assert torch.equal(saved.get(name, saved["transformer.wte.weight"]), tensor), name
    assert sorted(os.listdir(run / "hf")) == ["config.json", "model.safetensors"]
    assert export.num_bytes == sum(t.numel() * 4 for n, t in expected.items() if n != "lm_head.weight")
    assert export.dtype == "float32"


def test_slices_with_a_ranks_file_missing_are_refused_before_anything_is_written(sliced, tmp_path):
    checkpoint, run = sliced
    broken = tmp_path / "run"
    shutil.copytree(run / checkpoint_name(1), broken / checkpoint_name(1))
    os.remove(sorted((broken / checkpoint_name(1) / WEIGHTS_DIR).iterdir())[1])
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match=r"slices leave .* incomplete: a rank's file is missing"):
        write_sliced_weights(str(broken), TrainState({}, {}, 1, weights_sliced=True), model)
    assert not (broken / "model.pt").exists() and not (broken / "model.safetensors").exists()
