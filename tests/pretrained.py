"""Tiny Hugging Face checkpoints the tests write themselves (``save_pretrained``; nothing is
downloaded): a GPT-2 (tied embedding and head, learned positions, LayerNorm) and a Llama (RoPE,
RMSNorm, grouped-query attention, untied head), both without dropout, each with a byte-level
tokenizer whose vocabulary fits the model's."""

from __future__ import annotations

import torch

VOCAB = 300  # the byte tokens' 257 ids and some to spare, as a pretrained vocabulary is often padded
POSITIONS = 16


def write_gpt2(directory) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(11)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=256, eos_token_id=256,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(directory)
    return str(directory)


def write_llama(directory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(12)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=POSITIONS, tie_word_embeddings=False,
        bos_token_id=256, eos_token_id=256,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def pretrained_reference(cfg, reference_for):
    """The single-process reference for a run of ``cfg.model`` = ``hf:DIR``: the checkpoint loaded by
    transformers itself, trained by plain torch (``reference_for``), raypar's loading nowhere in it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = cfg.model.removeprefix("hf:")
    init_state = AutoModelForCausalLM.from_pretrained(directory).state_dict()

    def factory(in_features, out_features):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))

    return reference_for(cfg, init_state, factory=factory)


def write_tokenizer(directory) -> str:
    """A byte-level BPE of at most ``VOCAB`` ids trained on a standard library source, saved as a
    checkpoint's tokenizer is (``tokenizer.json``, ``tokenizer_config.json`` naming its eos)."""
    import sysconfig
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = Path(sysconfig.get_paths()["stdlib"], "textwrap.py").read_text()
    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    inner.train_from_iterator([text], trainer)
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>").save_pretrained(directory)
    return str(directory)
