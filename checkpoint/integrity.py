"""Per-array checksums: written into a step's meta on save, checked on every restore.

Orbax notices files that no longer decode; a checksum also catches damage that still
decodes (a flipped bit in uncompressed data, a step directory mixed up with another). Each
array's checksum is two 32-bit sums of its raw bits, one plain and one weighted by the
element's flat position, so a changed value and a moved value both show. Integer sums
modulo 2**32 do not depend on the order of addition, so the checksum is the same for any
sharding: it is computed where the array lives (a reduction, no gather) and a checkpoint
restored onto another mesh checks against the same numbers. Host (numpy) arrays are summed
in numpy to the same numbers, with no program to compile.

    >>> import jax.numpy as jnp
    >>> sums = checksums({"w": jnp.arange(4.0), "b": jnp.ones(3, jnp.bfloat16)})
    >>> sorted(sums), len(sums["w"])
    (['b', 'w'], 16)
    >>> sums == checksums({"w": jnp.arange(4.0), "b": jnp.ones(3, jnp.bfloat16)})
    True
    >>> mismatched(sums, {"w": jnp.arange(4.0)[::-1], "b": jnp.ones(3, jnp.bfloat16)})
    ['w']
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CHECKSUMS = "checksums"   # the meta key: {array name: 16 hex digits}
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits_u32(x: jax.Array) -> jax.Array:
    """The array's raw bits as uint32 words (64-bit elements give two words each)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = jnp.dtype(x.dtype).itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _flat_index(shape: tuple) -> jax.Array:
    idx = jnp.zeros(shape, jnp.uint32)
    for d, n in enumerate(shape):
        idx = idx * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    return idx


def _sums(x: jax.Array) -> jax.Array:
    # Host-offloaded state (``training.offload``) is summed on the device: XLA computes
    # there, the copy is one leaf's.
    u = _bits_u32(jax.device_put(x, jax.memory.Space.Device))
    weight = _flat_index(u.shape) * jnp.uint32(2) + jnp.uint32(1)   # odd: no bit is lost
    return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * weight, dtype=jnp.uint32)])


@jax.jit
def _all_sums(leaves: list) -> jax.Array:
    return jnp.stack([_sums(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def _host_sums(x: np.ndarray) -> tuple[int, int]:
    """``_sums`` of a host array, in numpy: the same words, weights and wrap-around sums
    (no device copy and no compile: ``Checkpointer.verify`` reads arrays back to the host)."""
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    if x.dtype.itemsize == 8:   # two little-endian words per element, as the bitcast gives
        u = x.view(np.uint32)
    else:
        u = x.view(np.dtype(_UNSIGNED[x.dtype.itemsize])).astype(np.uint32)
    weight = (np.arange(u.size, dtype=np.uint64) % 2 ** 32).astype(np.uint32) * np.uint32(2)
    weight += np.uint32(1)
    return int(np.sum(u, dtype=np.uint32)), int(np.sum(u * weight, dtype=np.uint32))


def array_name(path: tuple) -> str:
    """``opt_state.0.mu.embed``: the same whether a node is a named tuple (as saved) or the
    dict/list Orbax gives back without a target (as verified)."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


def checksums(tree: Any) -> dict[str, str]:
    """``{array_name(path): hex}`` for every array leaf of ``tree`` (sharded or not)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    on_host = [isinstance(x, (np.ndarray, np.generic)) for _, x in flat]
    leaves = [x for (_, x), h in zip(flat, on_host) if not h]
    sums = _all_sums(leaves) if leaves else np.zeros((0, 2), np.uint32)
    # A full reduction comes back replicated: any local shard holds every value, which also
    # works when the state spans several processes.
    device = iter(np.asarray(sums.addressable_data(0)) if isinstance(sums, jax.Array)
                  else sums)
    pairs = [_host_sums(np.asarray(x)) if h else next(device)
             for (_, x), h in zip(flat, on_host)]
    return {array_name(path): f"{int(a):08x}{int(b):08x}"
            for (path, _), (a, b) in zip(flat, pairs)}


def mismatched(saved: dict[str, str], tree: Any) -> list[str]:
    """Paths of ``tree`` whose checksum differs from ``saved`` (paths ``saved`` lacks are
    not checked: a partial restore checks what it restored)."""
    now = checksums(tree)
    return [k for k, v in now.items() if k in saved and saved[k] != v]


__all__ = ["CHECKSUMS", "array_name", "checksums", "mismatched"]
