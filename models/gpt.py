"""A small decoder-only transformer in nanoGPT's shape, as a ``NamedSequential`` the pipeline can cut.

``embed`` (token + position embedding) -> ``block_0`` .. ``block_{N-1}`` (pre-LayerNorm causal
self-attention and MLP, each with a residual) -> ``head`` (final LayerNorm, untied linear head).
``embed`` takes int64 tokens (B, T); every block takes and returns float activations (B, T, C); the
head returns logits (B, T, V). Plain torch, deterministic on CPU: attention runs through
``F.scaled_dot_product_attention`` and draws nothing at random unless ``dropout`` is above 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.named import NamedSequential


class Embed(nn.Module):
    """Token plus learned position embedding; refuses a sequence longer than ``block_size``."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        if length > self.block_size:
            raise ValueError(
                f"a sequence of {length} tokens is longer than the model's block_size {self.block_size}; "
                f"build it with --model-option block_size={length} or more"
            )
        positions = torch.arange(length, device=tokens.device)
        return self.drop(self.tok(tokens) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).contiguous().view(batch, length, width)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """The final LayerNorm and the (untied) projection to the vocabulary."""

    def __init__(self, n_embd: int, vocab_size: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt(
    in_features: int,
    out_features: int,
    n_layer: int = 2,
    n_head: int = 2,
    n_embd: int = 64,
    block_size: int = 64,
    dropout: float = 0.0,
) -> nn.Module:
    """A GPT over a vocabulary of ``in_features`` tokens predicting ``out_features`` (the same V
    for a language model). Weights as GPT-2 initialises them: N(0, 0.02), and the residual
    projections N(0, 0.02 / sqrt(2 n_layer)) so the residual stream's variance does not grow with depth."""
    if n_embd % n_head:
        raise ValueError(f"model 'gpt': n_embd {n_embd} must be a multiple of n_head {n_head}")
    children: dict[str, nn.Module] = {"embed": Embed(in_features, block_size, n_embd, dropout)}
    for index in range(n_layer):
        children[f"block_{index}"] = Block(n_embd, n_head, dropout)
    children["head"] = Head(n_embd, out_features)
    model = NamedSequential(**children)
    for name, parameter in model.named_parameters():
        if name.endswith("proj.weight"):
            nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * n_layer))
        elif parameter.dim() >= 2:  # Linear and Embedding weights; LayerNorms keep ones and zeros
            nn.init.normal_(parameter, std=0.02)
    return model


def block_size_of(model: nn.Module) -> int | None:
    """The longest sequence ``model`` takes, when it says (the built-in gpt's position table)."""
    embed = getattr(model, "embed", None)
    return getattr(embed, "block_size", None)
