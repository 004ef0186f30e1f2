"""What one op of a stage reads besides the parameters and the incoming activation:
:class:`StageInputs`, named, so the backward finds the last-chunk flag by its name rather
than by its place among the leaves.

    >>> import jax.numpy as jnp
    >>> si = StageInputs({"tokens": jnp.zeros((2, 8))}, {"inv_total_weight": 1.0}, True, False,
    ...                  jnp.arange(2))
    >>> leaf_positions(si).last, leaf_positions((jnp.zeros(3), si))[1].last
    (3, 4)
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax


class StageInputs(NamedTuple):
    """A stage's ``extras``. A NamedTuple: a pytree whose fields have names (the stages,
    ``pipeline.stage``, read them by name)."""

    inputs: Any      # this micro-batch's inputs, a dict of arrays
    consts: Any      # step-wide values every op sees (``inv_total_weight``, ``aux_scale``)
    first: Any       # bool: the chunk is the model's first (the pre-stack runs)
    last: Any        # bool: the chunk is the model's last (the post-stack runs)
    layers: Any      # int32 [Lc]: the chunk's layers' indices in the whole stack
    # int32: layers of the chunk's slots that run, the rest skipped (uneven stages,
    # ``StageLayers.slot_counts``); None (no leaf): every slot runs
    count: Any = None


def leaf_positions(tree):
    """``tree`` with each leaf replaced by its position among ``jax.tree.leaves(tree)``: a
    named field's flat index (a traced jaxpr's invar) read by name."""
    return jax.tree.unflatten(jax.tree.structure(tree), range(len(jax.tree.leaves(tree))))
