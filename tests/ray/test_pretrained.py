"""A Hugging Face checkpoint fine-tuned with ``--model hf:DIR`` by every strategy, the pipeline
included, ends on the weights of the same checkpoint fine-tuned by plain single-process torch (SGD:
AdamW would magnify the float-order noise of the workers' sums, as the brief measured); fsdp reads
it by slice and writes it back by slice. The checkpoints are tiny and written by the tests (tests/pretrained.py)."""

from __future__ import annotations

import pytest

from ray_jobs.pipeline.scaling import PipelineScaling
from tests.helpers import assert_same_weights, lm_config, load_weights, reference_for, run_strategy
from tests.pretrained import pretrained_reference, write_gpt2, write_llama, write_tokenizer

pytest.importorskip("transformers", reason="hf: needs transformers (pip install 'raypar[hf]')")

pytestmark = pytest.mark.ray

WRITERS = {"gpt2": write_gpt2, "llama": write_llama}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    written = {family: write(root / family) for family, write in WRITERS.items()}
    write_tokenizer(written["gpt2"])
    return written


@pytest.fixture(scope="module")
def gpt2_tokens(checkpoints, tmp_path_factory):
    """Real text tokenized by the GPT-2 checkpoint's own tokenizer, as a user starts."""
    import sysconfig

    from ray_jobs.data.__main__ import main

    out = tmp_path_factory.mktemp("gpt2-tokens")
    text = f"{sysconfig.get_paths()['stdlib']}/textwrap.py"
    argv = ["tokenize", "--input", text, "--output", str(out), "--block-size", "8", "--tokenizer", checkpoints["gpt2"]]
    assert main(argv) == 0
    return str(out / "train.parquet")


@pytest.mark.parametrize(
    "strategy, family, num_workers",
    # ddp on a Hugging Face GPT-2: tests/ray/test_lm_hf.py, from the user's own from_pretrained.
    # The pipeline's GPT-2 in 3 stages: embeddings | both layers | head, the tied weight on the first and last.
    [("fsdp", "gpt2", 2), ("fsdp", "llama", 2), ("ddp", "llama", 2), ("dp", "gpt2", 1), ("pipeline", "gpt2", 3),
     ("pipeline", "llama", 2)],
)  # fmt: skip
def test_a_pretrained_checkpoint_fine_tunes_to_the_single_process_weights(
    ray_cluster, tokens, gpt2_tokens, checkpoints, tmp_path, strategy, family, num_workers
):
    data = gpt2_tokens if family == "gpt2" else tokens  # the Llama's is byte tokens: 257 ids of its 300
    cfg = lm_config(data, tmp_path, model=f"hf:{checkpoints[family]}", model_option=[])
    scaling = PipelineScaling(num_stages=num_workers, num_microbatches=2) if strategy == "pipeline" else None
    summary = run_strategy(strategy, cfg, num_workers=num_workers, scaling=scaling)
    if strategy == "pipeline" and family == "gpt2":
        assert summary.extra["stage_children"] == [["embed"], ["transformer.h.0", "transformer.h.1"], ["head"]]
    expected, losses = pretrained_reference(cfg, reference_for)
    # Tolerance (assert_same_weights): the workers' float32 sums in another order than one batch's.
    assert_same_weights(load_weights(summary.run_dir), expected)
    assert summary.losses == pytest.approx(losses, rel=1e-5)
    assert_hands_back_the_trained_model(summary.run_dir, checkpoints[family])
    if family == "gpt2":  # generate samples from the run with the checkpoint's tokenizer
        from ray_jobs.predict.generate import load_language_model

        loaded = load_language_model(summary.run_dir)
        assert loaded.tokenizer.kind == "pretrained" and (tmp_path / "run" / "hf" / "tokenizer.json").exists()


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
