"""The pipeline's buffer primitives: one slot of a slotted buffer read (``take``) and written
in place (``put``), and the bytes of a shape (``nbytes``, ``tree_bytes``) — what the tick loop,
the stash slots, the buffer pricing and the run summary all count in.

A slotted buffer is ``[slots, *shape]``; ``put`` is a dynamic-update-slice, which XLA runs in
place when nothing reads the old buffer afterwards (``executor``'s per-op conditionals rely
on it).

    >>> import jax, jax.numpy as jnp
    >>> buf = put(jnp.zeros((3, 2)), jnp.ones(2), 1)
    >>> take(buf, 1).tolist(), take(buf, 0).tolist()
    ([1.0, 1.0], [0.0, 0.0])
    >>> nbytes(jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)), tree_bytes({"a": jnp.zeros(3)})
    (64, 12)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def take(buf, i):
    """Slot ``i`` of ``buf`` (its leading axis)."""
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def put(buf, x, i):
    """``buf`` with slot ``i`` set to ``x`` (cast to the buffer's dtype)."""
    return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)


def shape_bytes(shape, dtype) -> int:
    """Bytes of an array of ``shape`` and ``dtype``."""
    return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def nbytes(x) -> int:
    """Bytes of anything with ``shape`` and ``dtype`` (an array, a ShapeDtypeStruct, an
    aval)."""
    return shape_bytes(x.shape, x.dtype)


def tree_bytes(tree) -> int:
    """Bytes of every leaf of ``tree``."""
    return sum(nbytes(x) for x in jax.tree.leaves(tree))


def _state_starts(a, j, mb, axis):
    zero = jnp.zeros((), jnp.int32)
    starts = [zero] * a.ndim
    starts[0], starts[axis + 1] = j, mb
    return starts


def take_state(a, j, mb, axis: int):
    """The (chunk ``j``, micro-batch ``mb``) slice of a per-stage state leaf ``[v, ..., M,
    ...]`` (the micro-batch axis ``axis`` places after the chunk axis)."""
    sizes = list(a.shape)
    sizes[0] = sizes[axis + 1] = 1
    out = jax.lax.dynamic_slice(a, _state_starts(a, j, mb, axis), sizes)
    return out.squeeze((0, axis + 1))


def put_state(a, x, j, mb, axis: int):
    """``a`` with its (chunk ``j``, micro-batch ``mb``) slice set to ``x``, in place."""
    x = jnp.expand_dims(x.astype(a.dtype), (0, axis + 1))
    return jax.lax.dynamic_update_slice(a, x, _state_starts(a, j, mb, axis))
