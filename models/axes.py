"""Logical activation-sharding hook.

``models/`` names activation axes (``constrain(x_BTD, ("batch", "seq", "act_embed"))``) but
never a mesh. ``triax.sharding`` installs the resolver with ``using_constraint`` while a step
is traced; outside of that the hook is the identity, so the model runs anywhere unchanged.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional, Sequence

Constraint = Callable[[object, Sequence[Optional[str]]], object]

_CONSTRAINT: contextvars.ContextVar[Optional[Constraint]] = contextvars.ContextVar(
    "triax_activation_constraint", default=None)


def constrain(x, logical_axes: Sequence[Optional[str]]):
    fn = _CONSTRAINT.get()
    return x if fn is None else fn(x, tuple(logical_axes))


@contextlib.contextmanager
def using_constraint(fn: Optional[Constraint]):
    token = _CONSTRAINT.set(fn)
    try:
        yield
    finally:
        _CONSTRAINT.reset(token)
