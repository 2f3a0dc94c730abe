"""Write a small GPT-2-shaped Hugging Face checkpoint and its tokenizer into DIR, as
``hf download gpt2 --local-dir DIR`` would lay one out: ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``. Its weights are random and its BPE is learned on the
standard library's ``json`` package: it stands in for a downloaded checkpoint, so the fine-tuning
example runs on any machine, offline. Usage: python tiny_checkpoint.py DIR
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def main(directory: str) -> None:
    texts = [path.read_text() for path in sorted(Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py"))]
    inner = Tokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    inner.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=EOS, bos_token=EOS)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    print(f"wrote {directory}: {sum(p.numel() for p in GPT2LMHeadModel(config).parameters()):,} parameters")


if __name__ == "__main__":
    main(sys.argv[1])
