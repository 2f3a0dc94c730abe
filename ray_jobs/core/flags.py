"""The CLI flags generated from the config dataclasses, and the one-line ``ValueError`` their checks raise.

A field's ``flag_doc`` metadata is both its documentation and its ``--flag`` help text, so the
dataclasses are the single source of truth for names, defaults and meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

# Every entry point's --address (the flag is not a dataclass field: resume ignores it).
ADDRESS_HELP = (
    "Ray cluster to join: host:port of its head, or auto for the one `ray start` runs on this machine "
    "(default: RAY_ADDRESS, else a new local Ray)"
)
# The --help sections, in this order; the README's flag reference uses the same ones.
FLAG_GROUPS = ("data", "model", "training", "pipeline", "placement", "checkpoints", "ingest")


def flag_doc(help_text: str, group: str | None = None, default_text: str | None = None, **extra: Any) -> dict[str, Any]:
    """A field's flag: its help, its --help section, and what a ``None`` default means."""
    return {"help": help_text, "group": group, "default_text": default_text, **extra}


def require(ok: bool, flag: str, value: Any, what: str) -> None:
    if not ok:
        raise ValueError(f"--{flag.replace('_', '-')} must be {what}, got {value}")


def require_choice(value: str, choices: tuple[str, ...] | list[str], flag: str) -> None:
    if value not in choices:
        raise ValueError(f"--{flag.replace('_', '-')} {value!r} is unknown; valid: {', '.join(choices)}")


def require_divisible(batch_size: int, parts: int, flag: str) -> None:
    """The global batch must split into equal parts, else the mean-loss gradient changes."""
    if batch_size % parts:
        raise ValueError(f"--batch-size {batch_size} is not divisible by {flag} {parts}")


Config = TypeVar("Config")


def add_flags(parser: argparse.ArgumentParser, cls: type, default_group: str = "placement") -> None:
    """Add one ``--flag`` per dataclass field, in the --help section its metadata names (else
    ``default_group``), each with its default; a bool defaulting to True becomes ``--no-flag``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        group = flag_group(parser, meta.pop("group") or default_group)
        default = f.default if f.default is not dataclasses.MISSING else None
        default_text = meta.pop("default_text")
        # choices go into the help text: a bad value then fails in __post_init__ with one line.
        choices = meta.pop("choices", None)
        meta["help"] += f"; one of {', '.join(choices)}" if choices else ""
        if meta.get("action") == "append":  # a repeatable flag; the dataclass turns None into []
            meta["help"] += f" (default: {default_text})"
            group.add_argument(flag, dest=f.name, default=None, **meta)
            continue
        if hints[f.name] is bool:
            shown = default_text or ("on" if default else "off")
            meta["help"] += f" (default: {shown})"
            if default:
                group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", **meta)
            else:
                group.add_argument(flag, dest=f.name, action="store_true", **meta)
            continue
        scalar = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        meta["help"] += f" (default: {default_text if default is None else default})"
        group.add_argument(flag, dest=f.name, type=scalar, default=default, metavar=f.name.upper(), **meta)


def flag_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's section ``title``; all of ``FLAG_GROUPS`` are created at once, so --help
    lists them in that order whichever dataclass adds its flags first."""
    existing = {group.title: group for group in parser._action_groups}
    if title not in existing:
        for name in FLAG_GROUPS:
            if name not in existing:
                existing[name] = parser.add_argument_group(name)
    if title not in existing:
        raise ValueError(f"flag group {title!r} is not one of {', '.join(FLAG_GROUPS)}")
    return existing[title]


def from_args(cls: type[Config], args: argparse.Namespace) -> Config:
    """Build (and so validate) a config dataclass from parsed flags."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(args).items() if k in names})
