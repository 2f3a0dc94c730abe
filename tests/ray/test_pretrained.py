"""A Hugging Face checkpoint fine-tuned with ``--model hf:DIR`` by every data-parallel strategy ends
on the weights of the same checkpoint fine-tuned by plain single-process torch (SGD: AdamW would
magnify the float-order noise of the workers' sums, as the brief measured), and fsdp reads it by
slice. The checkpoints are tiny and written by the tests (tests/pretrained.py)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_same_weights, lm_config, load_weights, reference_for, run_strategy
from tests.pretrained import pretrained_reference, write_gpt2, write_llama

pytest.importorskip("transformers", reason="hf: needs transformers (pip install 'raypar[hf]')")

pytestmark = pytest.mark.ray

WRITERS = {"gpt2": write_gpt2, "llama": write_llama}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: write(root / family) for family, write in WRITERS.items()}


@pytest.mark.parametrize(
    "strategy, family, num_workers",
    [("fsdp", "gpt2", 2), ("fsdp", "llama", 2), ("ddp", "gpt2", 2), ("ddp", "llama", 2), ("dp", "llama", 1)],
)
def test_a_pretrained_checkpoint_fine_tunes_to_the_single_process_weights(
    ray_cluster, tokens, checkpoints, tmp_path, strategy, family, num_workers
):
    cfg = lm_config(tokens, tmp_path, model=f"hf:{checkpoints[family]}", model_option=[])
    summary = run_strategy(strategy, cfg, num_workers=num_workers)
    expected, losses = pretrained_reference(cfg, reference_for)
    # Tolerance (assert_same_weights): the workers' float32 sums in another order than one batch's.
    assert_same_weights(load_weights(summary.run_dir), expected)
    assert summary.losses == pytest.approx(losses, rel=1e-5)
    assert_hands_back_the_trained_model(summary.run_dir, checkpoints[family])


def assert_hands_back_the_trained_model(run_dir: str, checkpoint: str) -> None:
    """``hf/`` loads offline with ``from_pretrained`` to the run's own weights (``model.pt``, and
    ``model.safetensors`` beside it), so to its logits, with the checkpoint's tokenizer files."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    trained = load_weights(run_dir)
    exported = AutoModelForCausalLM.from_pretrained(f"{run_dir}/hf")
    assert_same_weights(exported.state_dict(), trained, exact=True)
    saved = load_file(f"{run_dir}/model.safetensors")
    assert all(torch.equal(saved[name], trained[name]) for name in saved) and len(saved) >= len(trained) - 1
    ours = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint))
    ours.load_state_dict(trained)
    batch = torch.arange(16).reshape(2, 8)
    torch.testing.assert_close(exported(batch).logits, ours(batch).logits, rtol=0, atol=0)
