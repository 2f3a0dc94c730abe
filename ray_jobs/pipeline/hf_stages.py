"""A Hugging Face causal LM (``--model hf:DIR``) cut into pipeline stages.

The units a cut falls between are the model's embeddings, each decoder layer, and its final norm
plus head. A stage holds its pieces at their paths in the model, so its ``state_dict`` keys are the
checkpoint's own (``transformer.h.3.attn.c_attn.weight``) and the stages' keys together are the
model's. A stage runs its pieces as the model's own ``forward`` runs them: the same calls, in the
same order, with the same mask and positions, so the stages in a row compute the model's logits
bit for bit. A tied embedding and head cut apart are one weight held by two stages
(``cut.shared_weights``).

Families whose ``forward`` is written here: GPT-2 and Llama. Another architecture's forward (its
masks, its positions, its extra inputs) would have to be written out the same way, so it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Family:
    """Where a family's pieces are in its causal LM, by ``get_submodule`` path."""

    embed: tuple[str, ...]
    """The embedding's modules, in the order its forward applies them."""
    layers: str
    """The decoder layers' ``ModuleList``."""
    head: tuple[str, ...]
    """The final norm, then the head."""
    with_layers: tuple[str, ...] = ()
    """Modules without weights that every stage with decoder layers calls (Llama's rotary embedding)."""


FAMILIES = {
    "gpt2": Family(
        ("transformer.wte", "transformer.wpe", "transformer.drop"), "transformer.h", ("transformer.ln_f", "lm_head")
    ),
    "llama": Family(("model.embed_tokens",), "model.layers", ("model.norm", "lm_head"), ("model.rotary_emb",)),
}
EMBED, HEAD = "embed", "head"


def family_of(model: nn.Module) -> str | None:
    """The family name of a Hugging Face causal LM the pipeline cuts; None for any other model."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type if model_type in FAMILIES else None


def is_hugging_face(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "_no_split_modules")


def refuse(model: nn.Module, name: str) -> ValueError:
    model_type = getattr(model.config, "model_type", type(model).__name__)
    return ValueError(
        f"--model {name} is a {model_type} model: the pipeline cuts Hugging Face {' and '.join(FAMILIES)} models "
        "(their embeddings, decoder layers, and final norm plus head are written out stage by stage); fine-tune "
        "this one with ray_jobs.ddp, ray_jobs.fsdp or ray_jobs.dp"
    )


def unit_labels(model: nn.Module) -> list[str]:
    """The units a cut falls between: ``embed``, each decoder layer by its path, ``head``."""
    family = FAMILIES[family_of(model)]
    layers = model.get_submodule(family.layers)
    return [EMBED, *(f"{family.layers}.{index}" for index in range(len(layers))), HEAD]


def unit_sizes(model: nn.Module) -> list[int]:
    """Each unit's parameter count: what a cut by parameters balances. A tied head counts its
    weight again: its stage holds a copy and runs the largest matmul with it."""
    family, labels = FAMILIES[family_of(model)], unit_labels(model)
    paths = [family.embed, *((label,) for label in labels[1:-1]), family.head]
    return [sum(p.numel() for path in unit for p in model.get_submodule(path).parameters()) for unit in paths]


class HFStage(nn.Module):
    """Units ``first`` to ``end`` (exclusive) of ``unit_labels(model)``, sharing ``model``'s modules."""

    def __init__(self, model: nn.Module, first: int, end: int) -> None:
        super().__init__()
        self.family = FAMILIES[family_of(model)]
        self.config = model.config  # the mask's settings: its attention implementation, its dtype rules
        labels = unit_labels(model)
        self.unit_labels = labels[first:end]
        self.has_embed, self.has_head = first == 0, end == len(labels)
        self.layer_paths = [label for label in self.unit_labels if label not in (EMBED, HEAD)]
        paths = [
            *(self.family.embed if self.has_embed else ()),
            *self.layer_paths,
            *(self.family.with_layers if self.layer_paths else ()),
            *(self.family.head if self.has_head else ()),
        ]
        for path in paths:
            _place(self, path, model.get_submodule(path))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        hidden = self._embed(x, positions) if self.has_embed else x
        if self.layer_paths:
            hidden = self._layers(hidden, positions)
        if self.has_head:
            for path in self.family.head:
                hidden = self.get_submodule(path)(hidden)
        return hidden

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.family is FAMILIES["gpt2"]:  # GPT2Model.forward: tokens + positions, then dropout
            wte, wpe, drop = (self.get_submodule(path) for path in self.family.embed)
            return drop(wte(tokens) + wpe(positions))
        return self.get_submodule(self.family.embed[0])(tokens)

    def _layers(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        # The mask the model's own forward makes, from the positions (it looks for packed documents
        # in them, with a read the meta device cannot do): without them GPT-2's logits moved 2e-7.
        # On meta (``cut.boundary_shapes``) only the shapes count.
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=None if hidden.is_meta else positions,
        )
        if self.family is FAMILIES["gpt2"]:  # GPT2Model.forward's call of each block
            for path in self.layer_paths:
                hidden = self.get_submodule(path)(hidden, None, mask, None, use_cache=False, position_ids=positions)
            return hidden
        rotary = self.get_submodule(self.family.with_layers[0])(hidden, position_ids=positions)
        for path in self.layer_paths:  # LlamaModel.forward's
            hidden = self.get_submodule(path)(
                hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions, use_cache=False
            )
        return hidden

    def checkpoint_units(self) -> list[tuple[str, nn.Module]]:
        """What ``--activation-checkpointing`` recomputes: each decoder layer."""
        return [(path, self.get_submodule(path)) for path in self.layer_paths]


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under ``root`` at ``path``, through empty containers for the parts above it."""
    *parents, name = path.split(".")
    for part in parents:
        if part not in root._modules:
            root.add_module(part, nn.Module())
        root = root._modules[part]
    root.add_module(name, module)


def split_hf(model: nn.Module, starts: list[int]) -> list[HFStage]:
    """The stages beginning at the unit indices ``starts`` (the first 0)."""
    ends = [*starts[1:], len(unit_labels(model))]
    return [HFStage(model, first, end) for first, end in zip(starts, ends)]
