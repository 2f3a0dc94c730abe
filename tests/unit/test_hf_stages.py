"""The pipeline's cut of a Hugging Face GPT-2 and Llama, without Ray: the stages in a row compute the
model's logits bit for bit, hold the checkpoint's own names, and a stage actor starts from its slice
with the buffers no checkpoint holds (Llama's rotary ``inv_freq``). Checkpoints are written here."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from models import NamedSequential, split_into_stages
from ray_jobs.core.config import TrainConfig
from ray_jobs.core.model_init import materialize
from ray_jobs.core.pretrained import params_on_meta
from ray_jobs.data.parquet import read_dataset
from ray_jobs.driver.prepare import prepare
from ray_jobs.pipeline.cut import SharedWeight, shared_weights, split_model, stage_keys, stage_units
from ray_jobs.pipeline.scaling import PipelineScaling
from ray_jobs.pipeline.stage import StageWorker
from tests.helpers import write_tokens
from tests.pretrained import VOCAB, write_gpt2, write_llama

transformers = pytest.importorskip("transformers", reason="hf: needs transformers (pip install 'raypar[hf]')")

WRITERS = {"gpt2": write_gpt2, "llama": write_llama}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: write(root / family) for family, write in WRITERS.items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_tokens(str(tmp_path_factory.mktemp("data") / "train.parquet"), rows=16, block_size=8)


def loaded(directory: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(directory, use_cache=False)


@pytest.mark.parametrize("family", WRITERS)
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_the_stages_in_a_row_are_the_model_bit_for_bit_under_its_own_names(checkpoints, family, num_stages):
    model = loaded(checkpoints[family])
    tokens = torch.randint(0, VOCAB, (3, 12))
    stages = split_model(model, num_stages, f"hf:{family}")
    out = tokens
    for stage in stages:
        out = stage(out)
    # Tolerance 0: the same modules called as the model's forward calls them, with the same mask.
    torch.testing.assert_close(out, model(tokens).logits, rtol=0, atol=0)
    keys = [set(stage.state_dict()) for stage in stages]
    assert set().union(*keys) == set(model.state_dict())
    assert sum(map(len, keys)) == len(model.state_dict())  # a tied pair is one key in each of two stages
    units = [unit for stage in stages for unit in stage_units(stage)]
    assert units[0] == ["embed"] and units[-1] == ["head"] and len(units) == model.config.num_hidden_layers + 2


def test_a_tied_embedding_and_head_cut_apart_are_one_weight_two_stages_hold(checkpoints):
    stages = split_model(loaded(checkpoints["gpt2"]), 3, "hf:gpt2")
    assert shared_weights(stages) == [SharedWeight({0: "transformer.wte.weight", 2: "lm_head.weight"})]
    assert shared_weights(split_model(loaded(checkpoints["llama"]), 3, "hf:llama")) == []


def test_every_stage_lists_the_shared_weights_in_one_order_whatever_it_calls_them():
    """The list's order is the tag each weight's gradients cross under: stage 2 names the two tied
    weights in the other alphabetical order than stage 0, and must still pair them alike."""
    a, b, middle, c, d = (torch.nn.Linear(4, 4) for _ in range(5))
    c.weight, d.weight = b.weight, a.weight
    stages = split_into_stages(NamedSequential(a=a, b=b, m=middle, c=c, d=d), 3, unit_costs=[1, 1, 2, 1, 1])
    assert [weight.names for weight in shared_weights(stages)] == [
        {0: "a.weight", 2: "d.weight"},
        {0: "b.weight", 2: "c.weight"},
    ]


def test_a_family_the_pipeline_does_not_write_out_is_refused_in_one_line():
    config = transformers.OPTConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="is a opt model: the pipeline cuts Hugging Face gpt2 and llama") as error:
        split_model(model, 2, "hf:opt")
    assert "\n" not in str(error.value)


def test_materialize_keeps_computed_buffers_and_ties(checkpoints):
    config = transformers.AutoConfig.from_pretrained(checkpoints["llama"])
    real = transformers.AutoModelForCausalLM.from_config(config)
    with params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    materialize(model, torch.device("cpu"))
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq, rtol=0, atol=0)
    with params_on_meta():
        gpt2 = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(checkpoints["gpt2"])
        )
    assert materialize(gpt2, torch.device("cpu")).lm_head.weight is gpt2.transformer.wte.weight


def test_a_llama_stage_starts_from_its_slice_and_its_own_rotary_embedding(checkpoints, data, tmp_path):
    cfg = TrainConfig(
        data=data, storage_path=str(tmp_path), name="run", model=f"hf:{checkpoints['llama']}", epochs=1, batch_size=8
    )
    prepared = prepare(cfg, "pipeline")
    dataset, factory = read_dataset(data), prepared.model_factory
    own = {name: prepared.initial_state[name] for name in stage_keys(prepared.cfg, dataset, 2, factory)[1]}
    assert "lm_head.weight" in own and "model.embed_tokens.weight" not in own
    stage = StageWorker(1, 2, 2, asdict(prepared.cfg), dataset, own, 1, False, model_factory=factory)
    hidden = torch.randn(2, 8, 16)
    model = loaded(checkpoints["llama"])
    expected = model.lm_head(model.model.norm(model.model.layers[1](
        hidden, position_embeddings=model.model.rotary_emb(hidden, torch.arange(8)[None]), attention_mask=None
    )))  # fmt: skip
    torch.testing.assert_close(stage.module(hidden), expected, rtol=0, atol=0)


def test_a_tied_weight_across_stages_needs_the_p2p_transport(checkpoints, data, tmp_path):
    cfg = TrainConfig(
        data=data, storage_path=str(tmp_path), name="run", model=f"hf:{checkpoints['gpt2']}", epochs=1, batch_size=8
    )
    prepared = prepare(cfg, "pipeline")
    with pytest.raises(ValueError, match="lm_head.weight and transformer.wte.weight are one weight held by two stages"):
        PipelineScaling(num_stages=2, num_microbatches=2, transport="actor_calls").check_model(prepared)
    PipelineScaling(num_stages=2, num_microbatches=2).check_model(prepared)  # auto: p2p
