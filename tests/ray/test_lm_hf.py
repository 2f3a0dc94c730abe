"""A Hugging Face model a user builds from a config in their own file (``GPT2LMHeadModel``, tied
embedding and head, output object with ``.logits``; nothing downloaded) trains with ddp to the
weights of plain single-process torch. An optional lane: ``transformers`` is no dependency of
raypar, only of its tests (``pip install 'raypar[test]'``)."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers import assert_same_weights, lm_config, load_weights, reference_for, run_strategy

pytest.importorskip("transformers", reason="the Hugging Face lane needs transformers (pip install 'raypar[test]')")

pytestmark = pytest.mark.ray

HF_LM = """
from transformers import GPT2Config, GPT2LMHeadModel


def build(in_features, out_features, n_layer=2, n_embd=16):
    # No dropout anywhere: each worker would draw its own masks. No cache: training returns logits only.
    config = GPT2Config(
        vocab_size=in_features, n_positions=16, n_embd=n_embd, n_layer=n_layer, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )
    return GPT2LMHeadModel(config)
"""


def test_a_hugging_face_gpt2_built_from_its_config_trains_with_ddp_as_one_process(
    ray_cluster, tokens, tmp_path, monkeypatch
):
    module = f"hf_lm_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{module}.py").write_text(HF_LM)
    monkeypatch.syspath_prepend(str(tmp_path))
    # SGD (lm_config's): AdamW would magnify the all-reduce's float-order noise on GPT-2's
    # near-zero-gradient biases (0.29 after 80 steps, as the brief measured).
    cfg = lm_config(tokens, tmp_path, model=f"{module}:build", model_option=["n_layer=2"])
    summary = run_strategy("ddp", cfg, num_workers=2)
    expected, _ = reference_for(cfg)
    # Tolerance (assert_same_weights): gloo's all-reduce order, float32.
    assert_same_weights(load_weights(summary.run_dir), expected)
