"""Expert parallelism: the MoE layer's token work per shard, experts behind an all-to-all.

``triax.models.moe`` routes, fills per-sequence capacity buffers ``buf_BECD``, runs the
experts and combines, all through a runner hook. Here the runner is a partial-manual
``shard_map``, manual over the token axes (``expert`` and the other batch axes, ``data``);
``tensor`` stays automatic, and so does ``pipe`` (or it is manual in an enclosing pipeline
``shard_map``, which this nests in). Per device, with b = B / (EP·DP) local sequences:

    x [b, T, D] → route, dispatch → buf [b, E, C, D] → [b, EP, E/EP, C, D]
      → all-to-all over expert: expert block j goes to rank j → [b, EP(src), E/EP, C, D]
      → SwiGLU with the local expert weights [E/EP, D, F] (F may be split over ``tensor``)
      → all-to-all back → [b, E, C, D] → combine → y [b, T, D]

Router statistics are token sums, added over the token axes with one ``psum``. Each
all-to-all moves b·E·C·D elements per device; a training step runs 4 per layer (dispatch
and combine, forward and backward): see ``all_to_all_bytes``.

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> from triax.models.moe import MoE
    >>> from triax.sharding.partition import activation_sharding
    >>> layer = MoE(config.TINY_MOE, nnx.Rngs(0))
    >>> with activation_sharding(make_mesh(data=2, expert=4), "dp"):   # installs this runner
    ...     y_BTD, aux = jax.jit(lambda x: layer(x, jnp.float32))(jnp.ones((8, 16, 64)))
    >>> y_BTD.shape
    (8, 16, 64)
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
from jax.sharding import Mesh, PartitionSpec as P

from triax.mesh.build import mesh_sizes
from triax.models import runtime
from triax.models.config import ModelConfig
from triax.models.moe import capacity, expert_ffn
from triax.sharding.rules import Rules, ShardingError


def expert_axes(mesh: Mesh, rules: Rules) -> tuple[str, ...]:
    """The mesh axes (size > 1) that experts are split over."""
    return rules.split_axes("experts", mesh_sizes(mesh))


def expert_parallel_size(mesh: Mesh, rules: Rules) -> int:
    return rules.split_size("experts", mesh_sizes(mesh))


def check_expert_mesh(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> None:
    """``num_experts`` must split evenly over the expert axis; the error says how to fix it."""
    if cfg.moe is None:
        return
    ep, E = expert_parallel_size(mesh, rules), cfg.moe.num_experts
    if E % ep:
        g = math.gcd(E, ep)
        raise ShardingError(
            f"model {cfg.name!r}: num_experts={E} is not divisible by the expert mesh axis "
            f"{expert_axes(mesh, rules)} of size {ep}; choose an expert axis size dividing {E} "
            f"(e.g. expert={g}, giving the other factor {ep // g} to data) or make num_experts "
            f"a multiple of {ep}")


def _token_axes(sizes: dict[str, int], rules: Rules, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Mesh axes the token buffer's batch dimension is split over: the expert axes, then the
    rest of the batch axes (manual too, so XLA cannot regather the batch over ``data``)."""
    batch = tuple(a for a in rules.mesh_axes("batch") if sizes.get(a, 1) > 1 and a not in axes)
    order = rules.mesh_axes("batch")
    if all(a in order for a in axes):  # follow the rules' order: no reshuffle at the boundary
        return tuple(a for a in order if a in axes or a in batch)
    return axes + batch


def varying_weight_axes(rules: Rules, sizes: dict[str, int]) -> tuple[str, ...]:
    """The batch axes besides the expert axes over which the runner marks the expert weights
    per-shard (``pcast``, so that their gradient's sum over those axes is fp32), where it is
    not nested in a pipeline's ``shard_map`` (which owns those axes already). The marked
    weights are a new value per layer, so the layer scan keeps each layer's copy of the
    device's expert weights for the backward (the planner counts it: ``costs.memory``).

    >>> from triax.sharding.rules import get_strategy
    >>> rules = get_strategy("dp").rules
    >>> varying_weight_axes(rules, {"data": 2, "expert": 4})
    ('data',)
    >>> varying_weight_axes(rules, {"expert": 8})
    ()
    """
    axes = rules.split_axes("experts", sizes)
    if not axes:
        return ()
    return tuple(a for a in _token_axes(sizes, rules, axes) if a not in axes)


def _all_to_all_runner(mesh, rules: Rules, axes: tuple[str, ...], ep: int) -> Callable:
    token_axes = _token_axes(mesh_sizes(mesh), rules, axes)
    w_spec = P(axes)

    def experts(buf_BECD, weights):
        b, E, C, D = buf_BECD.shape
        x = buf_BECD.reshape(b, ep, E // ep, C, D)
        x = jax.lax.all_to_all(x, axes, 1, 1, tiled=True)   # [b, src rank, local experts, C, D]
        y = expert_ffn(x, weights)
        y = jax.lax.all_to_all(y, axes, 1, 1, tiled=True)   # back to [b, dst rank, ...]
        return y.reshape(b, E, C, D)

    def local(token_fn, manual, x_BTD, router_DE, weights):
        data_axes = tuple(a for a in manual if a not in axes)
        if data_axes:  # mark the fp32 weights as per-shard now, so the gradient's psum over
            # data is fp32 (a bf16 one, after the cast, crashes XLA:CPU and loses precision)
            weights = tuple(jax.lax.pcast(w, data_axes, to="varying") for w in weights)
        with runtime.using(constraint=None):   # activation constraints name the full mesh
            y_BTD, stats = token_fn(x_BTD, router_DE, weights, experts)
        return y_BTD, jax.lax.psum(stats, manual)

    def run(token_fn, x_BTD, router_DE, weights):
        context = jax.sharding.get_abstract_mesh()
        # Inside an enclosing shard_map (the pipeline's) the context mesh carries its manual
        # axes; nest in it, manual over the token axes that are still automatic (the
        # enclosing one owns the rest, and sums their statistics itself). Otherwise use the
        # concrete mesh.
        nested = not context.empty and context.manual_axes
        m = context if nested else mesh
        manual = tuple(a for a in token_axes if not nested or a not in context.manual_axes)
        x_spec = P(manual)
        return jax.shard_map(
            functools.partial(local, token_fn, manual), mesh=m, axis_names=set(manual),
            in_specs=(x_spec, P(), (w_spec,) * len(weights)), out_specs=(x_spec, P()),
        )(x_BTD, router_DE, tuple(weights))
    return run


def expert_runner(mesh: Mesh, rules: Rules) -> Optional[Callable]:
    """The MoE runner for ``mesh`` (None: the MoE runs on whole arrays, no expert axis)."""
    axes = expert_axes(mesh, rules)
    if not axes:
        return None
    return _all_to_all_runner(mesh, rules, axes, expert_parallel_size(mesh, rules))


def all_to_all_bytes(cfg: ModelConfig, batch: int, seq_len: int, mesh: Mesh, rules: Rules,
                     itemsize: int = 4, forward_only: bool = False) -> dict:
    """Predicted all-to-all traffic of one step (per device, matching the compiled HLO).

    ``buffer`` is the per-device payload of one all-to-all: (B / (EP·DP))·E·C·D·itemsize;
    ``count`` = 2·L per forward (dispatch + combine), doubled for a training step. With a
    pipeline, L is the layers of one stage and the count repeats per micro-batch.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> from triax.sharding.rules import get_strategy
    >>> rules = get_strategy("dp").rules
    >>> all_to_all_bytes(config.TINY_MOE, 8, 32, make_mesh(data=2, expert=4), rules)
    {'buffer_bytes': 65536, 'count': 16, 'bytes_per_step': 1048576}
    """
    if cfg.moe is None or not expert_axes(mesh, rules):
        return {"buffer_bytes": 0, "count": 0, "bytes_per_step": 0}
    sizes, shards = mesh_sizes(mesh), 1
    for a in _token_axes(sizes, rules, expert_axes(mesh, rules)):
        shards *= sizes[a]
    C = capacity(cfg.moe, seq_len)
    buffer = (batch // shards) * cfg.moe.num_experts * C * cfg.embed_dim * itemsize
    count = 2 * cfg.num_layers * (1 if forward_only else 2)
    return {"buffer_bytes": buffer, "count": count, "bytes_per_step": buffer * count}
