"""A Hugging Face model a user builds in their own file, loading its weights with ``from_pretrained``
(``GPT2LMHeadModel``, tied embedding and head, output object with ``.logits``; a checkpoint the test
writes, nothing downloaded), trains with ddp to the weights of plain single-process torch: raypar
looks at the model with its parameters moved to meta as they are registered, which
``from_pretrained`` accepts (a meta device context it refuses). An optional lane: ``transformers``
is no dependency of raypar, only of its tests and ``raypar[hf]``."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers import assert_same_weights, lm_config, load_weights, reference_for, run_strategy
from tests.pretrained import write_gpt2

pytest.importorskip("transformers", reason="the Hugging Face lane needs transformers (pip install 'raypar[test]')")

pytestmark = pytest.mark.ray

HF_LM = """
from transformers import GPT2LMHeadModel


def build(in_features, out_features, path=""):
    # The checkpoint has no dropout: each worker would draw its own masks.
    return GPT2LMHeadModel.from_pretrained(path)
"""


def test_a_hugging_face_gpt2_a_user_loads_with_from_pretrained_trains_with_ddp_as_one_process(
    ray_cluster, tokens, tmp_path, monkeypatch
):
    module = f"hf_lm_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{module}.py").write_text(HF_LM)
    monkeypatch.syspath_prepend(str(tmp_path))
    # SGD (lm_config's): AdamW would magnify the all-reduce's float-order noise on GPT-2's
    # near-zero-gradient biases (0.29 after 80 steps, as the brief measured).
    checkpoint = write_gpt2(tmp_path / "gpt2")
    cfg = lm_config(tokens, tmp_path, model=f"{module}:build", model_option=[f"path={checkpoint}"])
    summary = run_strategy("ddp", cfg, num_workers=2)
    expected, _ = reference_for(cfg)  # builds with the same function: from the same pretrained weights
    # Tolerance (assert_same_weights): gloo's all-reduce order, float32.
    assert_same_weights(load_weights(summary.run_dir), expected)
