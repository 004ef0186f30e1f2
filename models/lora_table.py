"""A serving table of LoRA adapters, one picked per row (punica-style gathered factors).

``LoraConfig(slots=N)`` gives each adapted projection a :class:`LoraTable` in place of a
``LoraPair``: ``a`` ``[N + 1, *in, r]`` and ``b`` ``[N + 1, r, *out]``, with the logical axis
``adapter_slots`` in front of the pair's own (so the rules shard a table like its base weight
and replicate the slots). Slot 0 is no adapter (zeros, never written); an adapter of rank
below ``r`` fills its first rows and leaves the rest zero, and its ``alpha / r`` is folded
into its B when it is written (``inference.adapter_table``). The shapes never depend on
what is loaded, so loading an adapter is a write into a slot, never a new program.

A step names each row's slot in the runtime (``Runtime.adapter_rows``, int32 ``[B]``): the
table gathers every row's A and B and adds ``x·A[row]·B[row]`` to that row alone. Without
it (a plain forward) every row is slot 0, the base model.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from triax.models.config import LoraConfig
    >>> t = LoraTable((2,), ("embed",), (3,), ("mlp",), LoraConfig(rank=1, slots=2))
    >>> t.b[...] = t.b[...].at[1].set(1.0); t.a[...] = t.a[...].at[1].set(2.0)
    >>> x = jnp.ones((2, 1, 2))
    >>> with runtime.using(adapter_rows=jnp.array([1, 0])):
    ...     t(x, jnp.float32)[:, 0].tolist()
    [[4.0, 4.0, 4.0], [0.0, 0.0, 0.0]]
"""
from __future__ import annotations

import string

import jax.numpy as jnp
from flax import nnx

from triax.models import runtime
from triax.models.config import LoraConfig

SLOT_AXIS = "adapter_slots"


class LoraTable(nnx.Module):
    """``slots + 1`` adapter pairs of rank ``rank`` at most for one target; ``__call__``
    adds each row's own (see the module docstring)."""

    def __init__(self, in_shape, in_axes, out_shape, out_axes, lora: LoraConfig, *_):
        n, r = lora.slots + 1, lora.rank
        self.a = nnx.Param(jnp.zeros((n,) + tuple(in_shape) + (r,), jnp.float32),
                           out_sharding=(SLOT_AXIS,) + tuple(in_axes) + ("lora_rank",),
                           eager_sharding=False)
        self.b = nnx.Param(jnp.zeros((n, r) + tuple(out_shape), jnp.float32),
                           out_sharding=(SLOT_AXIS, "lora_rank") + tuple(out_axes),
                           eager_sharding=False)

    def __call__(self, x, dtype):
        rows_B = runtime.current().adapter_rows
        if rows_B is None:
            rows_B = jnp.zeros(x.shape[:1], jnp.int32)
        n_in, n_out = self.a.ndim - 2, self.b.ndim - 2
        ins, outs = string.ascii_lowercase[:n_in], string.ascii_uppercase[:n_out]
        a_B = jnp.take(self.a[...].astype(dtype), rows_B, axis=0)   # [B, *in, r]
        b_B = jnp.take(self.b[...].astype(dtype), rows_B, axis=0)   # [B, r, *out]
        z = jnp.einsum(f"zy{ins},z{ins}x->zyx", x, a_B)              # [B, T, r]
        return jnp.einsum(f"zyx,zx{outs}->zy{outs}", z, b_B)
