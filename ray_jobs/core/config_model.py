"""``TrainConfig``'s flags for the model: which one, its options, its initial weights (``ModelFlags``),
and how ``--model-option KEY=VALUE`` is read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models import MODELS
from ray_jobs.core.flags import flag_doc


@dataclass
class ModelFlags:
    """The model and its options (``--help`` section ``model``)."""

    model: str = field(
        default="seed-mlp",
        metadata=flag_doc(
            f"a registered model ({', '.join(sorted(MODELS))}); your own as module.path:callable, imported from "
            "the working directory or PYTHONPATH and called as callable(in_features, out_features, **options) to "
            "return an nn.Module; or hf:DIR, a Hugging Face causal LM checkpoint (config.json and safetensors, a "
            "directory or a URI; pip install 'raypar[hf]'), its weights the starting weights",
            "model",
        ),
    )
    model_option: list[str] = field(
        default_factory=list,
        metadata=flag_doc(
            "KEY=VALUE passed to the model as an option (the value read as int, float, true/false, else a string); "
            "repeat for more",
            "model",
            "none",
            metavar="KEY=VALUE",
            action="append",
        ),
    )
    hidden: int | None = field(
        default=None,
        metadata=flag_doc(
            "hidden width (seed-mlp, seed-split, mlp); for any model, short for --model-option hidden=N",
            "model",
            "the model's: 10, 5, 64",
        ),
    )
    depth: int | None = field(default=None, metadata=flag_doc("number of Linear layers (mlp)", "model", "4"))
    dropout: float | None = field(
        default=None, metadata=flag_doc("dropout probability after each hidden layer (mlp)", "model", "0, none")
    )
    init_from: str | None = field(
        default=None,
        metadata=flag_doc(
            "initial weights: a full state_dict (.pt) of the unsplit model, or safetensors (a file, or a directory "
            "of them: a run's hf/ or a checkpoint's)",
            "model",
            "built after manual_seed(--seed); hf:DIR's own",
        ),
    )

    @property
    def model_options(self) -> dict[str, Any]:
        """The model's keyword options: each --model-option, and the --hidden/--depth/--dropout given."""
        options = parse_model_options(self.model_option)
        for key in ("hidden", "depth", "dropout"):
            value = getattr(self, key)
            if value is not None:
                if key in options:
                    raise ValueError(f"--{key} and --model-option {key}=... both set {key}; give one")
                options[key] = value
        return options


# Keys of summary.json's model record and build_model's own arguments, beside the options.
RESERVED_OPTIONS = ("name", "in_features", "out_features", "factory")


def parse_model_options(pairs: list[str]) -> dict[str, Any]:
    """``["hidden=8", "norm=true", "act=gelu"]`` -> ``{"hidden": 8, "norm": True, "act": "gelu"}``."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or not key.isidentifier():
            raise ValueError(f"--model-option {pair!r} must be KEY=VALUE with KEY a Python name (e.g. hidden=64)")
        if key in RESERVED_OPTIONS:
            raise ValueError(
                f"--model-option {key}=... is not an option: the model is called with "
                "(in_features, out_features) from the data"
            )
        if key in options:
            raise ValueError(f"--model-option {key} is given twice")
        options[key] = parse_option_value(text)
    return options


def parse_option_value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
