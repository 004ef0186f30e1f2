"""A frozen config dataclass's leaf fields as argparse flags (the dataclass-as-CLI pattern,
for every command's config): the flag is the field name with ``-`` (sections are walked,
``triax.configs.leaves``, so ``--lr`` is ``--lr`` whichever section holds it), the type comes
from the annotation, the help, ``choices`` and ``default_help`` from the field's metadata.
``bool`` fields are switches (``--resume``; one that defaults to True gets ``--no-<name>``);
a ``tuple[T, ...]`` field is a repeatable flag. Flags default to None, so a ``--config`` file
and the dataclass defaults fill what the command line leaves out.

    >>> import argparse
    >>> from triax.training.config import RunConfig
    >>> p = argparse.ArgumentParser()
    >>> add_flags(p, RunConfig, ["steps", "precision", "progress"])
    >>> given(p.parse_args(["--steps", "3", "--no-progress"]), RunConfig)
    {'steps': 3, 'progress': False}
"""
from __future__ import annotations

import argparse
import typing
from typing import Iterable, Optional

from triax.configs import leaves


def _scalar(annotation):
    """``Optional[int]`` -> int, ``tuple[int, ...]`` -> int; plain types unchanged."""
    args = [a for a in typing.get_args(annotation) if a is not type(None) and a is not ...]
    return _scalar(args[0]) if args else annotation


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(p, cls, names: Optional[Iterable[str]] = None, defaults: Optional[dict] = None,
              notes: Optional[dict] = None, fill: bool = False,
              aliases: Optional[dict] = None) -> None:
    """Add a flag per leaf of ``cls`` in ``names`` (all when None), with the field's help and
    choices, so a flag several commands share is written once.

    ``defaults``: the command's own default where it differs from the field's (shown in the
    help; a field's ``default_help`` metadata describes a default that is not a plain value).
    ``notes``: a clause the command adds to a field's help, in place of the shown default.
    ``fill``: the parsed value is the default when the flag is left out, for commands that
    read ``args`` directly; otherwise None, so a ``--config`` file and ``cls`` fill it.
    ``aliases``: a field's older flag names, still accepted."""
    found, defaults, notes = leaves(cls), defaults or {}, notes or {}
    for name in (found if names is None else names):
        leaf = found[name]
        f, typ = leaf.field, _scalar(leaf.annotation)
        default = defaults.get(name, f.default)
        help_ = f.metadata["help"].replace("%", "%%")
        parsed = default if fill else None
        if typ is bool:
            if default:
                p.add_argument("--no-" + name.replace("_", "-"), dest=name,
                               action="store_false", default=parsed, help=f"no {help_}")
            else:
                p.add_argument(flag_name(name), action="store_true", default=parsed, help=help_)
            continue
        if name in notes:
            help_ += "; " + notes[name].replace("%", "%%")
        else:
            shown = f.metadata.get("default_help") if default == f.default else None
            if shown is None and default not in (None, "", ()):
                shown = default
            if shown is not None:
                help_ += f" (default: {shown})"
        repeat = typing.get_origin(leaf.annotation) is tuple
        p.add_argument(flag_name(name), *(aliases or {}).get(name, ()), type=typ, dest=name,
                       default=parsed, help=help_,
                       choices=f.metadata.get("choices"), action="append" if repeat else None,
                       metavar=f.metadata.get("metavar"))


def given(args: argparse.Namespace, cls) -> dict:
    """The leaves of ``cls`` given on the command line: every flag defaults to None, the one
    sentinel that tells a given flag from a default (``--plan auto`` keeps these fixed)."""
    found = leaves(cls)
    return {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items()
            if k in found and v is not None}


def add_json(p, help: str = "print one JSON object") -> None:
    """``--json``: a command's machine-readable output, in place of its text."""
    p.add_argument("--json", action="store_true", help=help)
