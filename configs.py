"""Frozen config dataclasses made of sections: the walk that finds their leaf fields, and
the flat view of them (one name per leaf) that flags, config files and old checkpoints use.

A field whose type is a dataclass is a section; every other field is a leaf. A leaf is
named by its field name alone, so names are unique across sections (``leaves`` asserts it)
and ``--lr`` stays ``--lr`` wherever the field lives. JAX-free: the CLI walks these before
JAX may start.

    >>> from dataclasses import dataclass, field
    >>> @dataclass(frozen=True)
    ... class Optim:
    ...     lr: float = 1e-3
    >>> @dataclass(frozen=True)
    ... class Job:
    ...     steps: int = 10
    ...     optim: Optim = field(default_factory=Optim)
    >>> sorted(leaves(Job))
    ['lr', 'steps']
    >>> job = from_flat(Job, {"lr": 0.1, "steps": 3})
    >>> job.optim.lr, flat(replace_flat(job, lr=0.2))
    (0.1, {'steps': 3, 'lr': 0.2})
    >>> from_flat(Job, {"optim": {"lr": 0.5}}).optim.lr   # a [section] table
    0.5
"""
from __future__ import annotations

import dataclasses
import functools
import typing
import warnings
from typing import Any, NamedTuple

from triax import choices


class Leaf(NamedTuple):
    path: tuple[str, ...]          # the sections above it, outermost first
    field: dataclasses.Field
    annotation: Any                # the resolved type hint


def _hints(cls) -> dict:
    """``cls``'s resolved annotations; a section is named by its ``default_factory`` too, so
    a class defined in a function (a test's) resolves."""
    local = {f.default_factory.__name__: f.default_factory for f in dataclasses.fields(cls)
             if isinstance(f.default_factory, type)}
    return typing.get_type_hints(cls, localns=local)


@functools.cache
def leaves(cls) -> dict[str, Leaf]:
    """Every leaf field of ``cls`` by name, sections walked in field order."""
    out: dict[str, Leaf] = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        sub = hints[f.name]
        if dataclasses.is_dataclass(sub):
            for name, leaf in leaves(sub).items():
                assert name not in out, f"{cls.__name__}: field {name!r} is in two sections"
                out[name] = Leaf((f.name, *leaf.path), leaf.field, leaf.annotation)
        else:
            assert f.name not in out, f"{cls.__name__}: field {f.name!r} is in two sections"
            out[f.name] = Leaf((), f, sub)
    return out


def sections(cls) -> dict[str, type]:
    """``cls``'s direct sections: field name -> the section's dataclass."""
    hints = _hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if dataclasses.is_dataclass(hints[f.name])}


def _nest(cls, values: dict) -> dict:
    """Flat leaf values (and ``{section: {...}}`` tables) as ``cls``'s constructor kwargs."""
    secs, found = sections(cls), leaves(cls)
    kw: dict = {}
    own: dict[str, dict] = {name: {} for name in secs}
    for key, value in values.items():
        if key in secs and isinstance(value, dict):
            own[key].update(value)
        elif key in found and found[key].path:
            own[found[key].path[0]][key] = value
        elif key in found:
            kw[key] = value
        else:
            raise TypeError(f"{cls.__name__} has no field {key!r}")
    for name, sub in secs.items():
        if own[name]:
            kw[name] = sub(**_nest(sub, own[name]))
    return kw


def from_flat(cls, values: dict):
    """``cls`` from flat leaf values (a ``[section]`` table may stand for its leaves)."""
    return cls(**_nest(cls, values))


def replace_flat(obj, **values):
    """``obj`` with the named leaves replaced, wherever their sections are."""
    secs = sections(type(obj))
    kw = {k: v for k, v in values.items() if k not in leaves(type(obj)) or
          not leaves(type(obj))[k].path}
    by_sec: dict[str, dict] = {}
    for key, value in values.items():
        path = leaves(type(obj))[key].path if key in leaves(type(obj)) else ()
        if path:
            by_sec.setdefault(path[0], {})[key] = value
    for name, vals in by_sec.items():
        assert name in secs
        kw[name] = replace_flat(getattr(obj, name), **vals)
    return dataclasses.replace(obj, **kw)


def flat(obj) -> dict:
    """Every leaf of ``obj`` by name (the flat JSON older checkpoints stored)."""
    return {name: get(obj, name) for name in leaves(type(obj))}


def get(obj, name: str):
    """The leaf ``name`` of ``obj``, wherever its section is."""
    for part in leaves(type(obj))[name].path:
        obj = getattr(obj, part)
    return getattr(obj, name)


def check_fields(obj, bounds: dict) -> None:
    """``obj``'s own leaves against their ``choices`` metadata and ``bounds`` (name ->
    ``(must, ok, fix)``), so a config file fails as the flag would, naming the flag and the
    fix. None is "not set" (an Optional field) and passes."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if "choices" in f.metadata and value is not None:
            choices.check(f.name, value, f.metadata["choices"])
        if f.name in bounds and value is not None:
            must, ok, fix = bounds[f.name]
            if not ok(value):
                raise ValueError(f"--{f.name.replace('_', '-')} {value:g}: must be {must}; {fix}")


# The usual bounds (``(must, ok)``; a config's ``bounds`` adds the fix its error names).
GE1, GT0, GE0 = ("≥ 1", lambda v: v >= 1), ("> 0", lambda v: v > 0), ("≥ 0", lambda v: v >= 0)


def warn_inert(messages, category=UserWarning) -> None:
    """Warn once per sentence naming a flag that has no effect (``inert_flags``' answers)."""
    for m in messages:
        warnings.warn(m, category, stacklevel=3)
