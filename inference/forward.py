"""The cached forward an engine jits: plain SPMD, or pipelined over ``pipe``.

Both have the signature ``fwd(params, tokens_BT, positions_BT, cache) -> (logits_BTV, cache)``
and the same math (``triax.models.decode``); only the placement differs.

Pipeline decode (``pipe > 1``): a ``shard_map`` manual over ``pipe`` only (``data``,
``tensor`` stay automatic), each stage holding its ``L/S`` layers and those layers' cache.
The batch is split into ``M`` micro-batches that flow through a forward-only schedule: at
tick ``t`` stage ``s`` runs micro-batch ``t - s`` (``M + S - 1`` ticks, one ``lax.scan``),
idle ticks skip their compute with ``lax.cond``, activations move to the next stage by
``ppermute``, the embedding runs on stage 0 and the head on the last stage.
This is triax's own small forward-only tick loop; it is meant to be unified with
``triax.pipeline``'s forward-only schedule once that lands.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from triax.mesh.build import mesh_sizes
from triax.models.decode import forward_with_cache, scan_blocks_with_cache
from triax.models.layers import ExecConfig
from triax.models.axes import using_constraint
from triax.sharding.partition import AbstractModel, activation_sharding
from triax.sharding.rules import ShardingError, Strategy


def plain_forward(am: AbstractModel, mesh: Mesh, strategy: Strategy,
                  exe: ExecConfig) -> Callable:
    """One SPMD program; XLA inserts the tensor-parallel collectives."""
    def fwd(params, tokens_BT, positions_BT, cache):
        with activation_sharding(mesh, strategy):
            return forward_with_cache(nnx.merge(am.graphdef, params), tokens_BT, positions_BT,
                                      cache, exe)
    return fwd


def check_pipeline(am: AbstractModel, mesh: Mesh, batch: int, microbatches: int) -> None:
    """Raise a clear error for a layout the pipelined forward cannot run."""
    sizes = mesh_sizes(mesh)
    S, L = sizes["pipe"], am.cfg.num_layers
    if L % S:
        raise ShardingError(f"pipeline decode needs num_layers={L} divisible by pipe={S}; "
                            f"choose pipe dividing {L}")
    if batch % (microbatches * sizes["data"]):
        raise ShardingError(
            f"pipeline decode splits the batch {batch} into {microbatches} micro-batches, "
            f"each sharded over data={sizes['data']}: choose a batch divisible by "
            f"{microbatches * sizes['data']}")


def _stage_program(am: AbstractModel, S: int, M: int, exe: ExecConfig):
    """The per-stage tick loop run inside ``shard_map`` (arrays are this stage's shards)."""
    last, perm = S - 1, [(i, i + 1) for i in range(S - 1)]

    def program(rest, blocks, tokens_JMT, positions_JMT, k, v):
        model = nnx.merge(am.graphdef, {**rest, "blocks": blocks})
        gd, st = nnx.split(model.blocks)
        s = jax.lax.axis_index("pipe")
        J, _, T = tokens_JMT.shape
        V = am.cfg.vocab_size
        x0 = jnp.zeros((J, T, am.cfg.embed_dim), exe.dtype)
        out = jnp.zeros((J, M, T, V), jnp.float32)

        def tick(carry, t):
            recv, k, v, out = carry
            m = jnp.clip(t - s, 0, M - 1)
            valid = (t - s >= 0) & (t - s < M)
            tok = jax.lax.dynamic_index_in_dim(tokens_JMT, m, 1, keepdims=False)
            pos = jax.lax.dynamic_index_in_dim(positions_JMT, m, 1, keepdims=False)
            x = jnp.where(s == 0, model.embed_tokens(tok, exe), recv)
            km = jax.lax.dynamic_index_in_dim(k, m, 2, keepdims=False)
            vm = jax.lax.dynamic_index_in_dim(v, m, 2, keepdims=False)
            y, km, vm = jax.lax.cond(
                valid, lambda a: scan_blocks_with_cache(gd, st, a[0], pos, a[1], a[2], exe),
                lambda a: a, (x, km, vm))
            k = jax.lax.dynamic_update_index_in_dim(k, km, m, 2)
            v = jax.lax.dynamic_update_index_in_dim(v, vm, m, 2)
            lg = jax.lax.cond(valid & (s == last),
                              lambda y: model.logits(y, exe).astype(jnp.float32),
                              lambda y: jax.lax.dynamic_index_in_dim(out, m, 1, False), y)
            out = jax.lax.dynamic_update_index_in_dim(out, lg, m, 1)
            return (jax.lax.ppermute(y, "pipe", perm), k, v, out), None

        (_, k, v, out), _ = jax.lax.scan(tick, (x0, k, v, out), jnp.arange(M + S - 1))
        return out[None], k, v
    return program


def pipelined_forward(am: AbstractModel, mesh: Mesh, strategy: Strategy, exe: ExecConfig,
                      microbatches: int) -> Callable:
    """Decode through ``pipe`` stages; micro-batch ``m`` is the rows ``b ≡ m (mod M)``.

    Strided micro-batches keep each one spread over ``data`` the same way the batch is.
    """
    S, M = mesh_sizes(mesh)["pipe"], microbatches
    program = jax.shard_map(
        _stage_program(am, S, M, exe), mesh=mesh, axis_names={"pipe"}, check_vma=False,
        in_specs=(P(), P("pipe"), P(), P(), P("pipe"), P("pipe")),
        out_specs=(P("pipe"), P("pipe"), P("pipe")))

    def fwd(params, tokens_BT, positions_BT, cache):
        B, T = tokens_BT.shape
        J = B // M
        rest = {k: v for k, v in params.items() if k != "blocks"}
        split = lambda a: a.reshape(a.shape[:1] + (J, M) + a.shape[2:])  # noqa: E731
        # No activation constraints inside the stage program: conditionals need one sharding
        # across branches, so XLA propagates it from the (tensor-sharded) parameters instead.
        with using_constraint(None):
            out, k, v = program(rest, params["blocks"], tokens_BT.reshape(J, M, T),
                                positions_BT.reshape(J, M, T), split(cache["k"]),
                                split(cache["v"]))
        merge = lambda a: a.reshape(a.shape[:1] + (B,) + a.shape[3:])  # noqa: E731
        return out[-1].reshape(B, T, -1), {"k": merge(k), "v": merge(v)}
    return fwd
