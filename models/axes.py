"""Logical activation-sharding hook.

``models/`` names activation axes (``constrain(x_BTD, ("batch", "seq", "act_embed"))``) but
never a mesh. ``triax.sharding`` installs the resolver as the runtime's ``constraint``
(``models.runtime.using``) while a step is traced; outside of that the hook is the identity,
so the model runs anywhere unchanged.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from triax.models import runtime

Constraint = Callable[[object, Sequence[Optional[str]]], object]


def constrain(x, logical_axes: Sequence[Optional[str]]):
    fn = runtime.current().constraint
    return x if fn is None else fn(x, tuple(logical_axes))
