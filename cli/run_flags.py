"""``RunConfig``'s fields as argparse flags (the dataclass-as-CLI pattern): the flag is the
field name with ``-``, the type comes from the annotation, the help from the field's
metadata; ``bool`` fields are switches (``--resume``; a field that defaults to True gets
``--no-<name>``, e.g. ``--no-progress``). Flags default to None, so a ``--config`` file and
the dataclass defaults fill what the command line leaves out.

    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_run_flags(p, ["steps", "precision", "progress"])
    >>> args = p.parse_args(["--steps", "3", "--no-progress"])
    >>> run_values(args)
    {'steps': 3, 'progress': False}
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Iterable, Optional

# JAX-free (see training/config.py): the parser is built before the device count is set.
from triax.training.config import RunConfig

_HINTS = typing.get_type_hints(RunConfig)
FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}


def _scalar(annotation) -> type:
    """``Optional[int]`` -> int; plain types unchanged."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def add_run_flags(p: argparse.ArgumentParser, names: Optional[Iterable[str]] = None,
                  defaults: Optional[dict] = None, notes: Optional[dict] = None,
                  fill: bool = False) -> None:
    """Add a flag per ``RunConfig`` field in ``names`` (all when None), with the field's help
    and choices, so a flag several commands share is written once.

    ``defaults``: the command's own default where it differs from ``RunConfig``'s (shown in
    the help; a field's ``default_help`` metadata describes a default that is not a plain
    value). ``notes``: a clause the command adds to a field's help, in place of the shown
    default (what the flag does there, and its default when that is not a plain value).
    ``fill``: the parsed value is the command's default when the flag is left out, for
    commands that read ``args`` directly; otherwise None, so a ``--config`` file and
    ``RunConfig`` fill it (see ``run_values``)."""
    defaults, notes = defaults or {}, notes or {}
    for name in (FIELDS if names is None else names):
        f = FIELDS[name]
        typ = _scalar(_HINTS[name])
        default = defaults.get(name, f.default)
        help_ = f.metadata["help"].replace("%", "%%")
        flag = "--" + name.replace("_", "-")
        parsed = default if fill else None
        if typ is bool:
            if default:
                p.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_false",
                               default=parsed, help=f"no {help_}")
            else:
                p.add_argument(flag, action="store_true", default=parsed, help=help_)
            continue
        if name in notes:
            help_ += "; " + notes[name].replace("%", "%%")
        else:
            shown = f.metadata.get("default_help") if default == f.default else None
            if shown is None and default not in (None, ""):
                shown = default
            if shown is not None:
                help_ += f" (default: {shown})"
        p.add_argument(flag, type=typ, default=parsed, choices=f.metadata.get("choices"),
                       help=help_)


def run_values(args: argparse.Namespace) -> dict:
    """The ``RunConfig`` fields given on the command line: every flag defaults to None, the
    one sentinel that tells a given flag from a default (``--plan auto`` keeps these fixed)."""
    return {k: v for k, v in vars(args).items() if k in FIELDS and v is not None}
