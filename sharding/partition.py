"""Abstract parameters → logical axes → ``NamedSharding``s → parameters created already split.

The journey of one parameter:
  1. ``abstract_model`` traces the model's constructor with ``nnx.eval_shape``: shapes,
     dtypes and logical axes, no memory.
  2. ``param_shardings`` resolves each logical tuple through the strategy's rules.
  3. ``init_params`` runs the constructor under ``jit(out_shardings=…)``, so every device
     materialises only its own shard. The same abstract tree is the Orbax restore target.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from triax.mesh.build import mesh_sizes
from triax.models import runtime
from triax.models.config import ModelConfig
from triax.models.lora import is_adapter_path
from triax.models.transformer import Transformer
from triax.sharding.collective_matmul import collective_matmuls
from triax.sharding.context import context_attention
from triax.sharding.experts import check_expert_mesh, expert_runner
from triax.sharding.rules import Rules, ShardingError, Strategy, get_strategy

PyTree = Any


def path_str(path) -> str:
    parts = []
    for k in path:
        k = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        parts.append(str(k))
    return "/".join(parts)


@dataclass(frozen=True)
class AbstractModel:
    """Everything known about a model before any memory is spent.

    ``make`` builds the real module from ``nnx.Rngs`` (under ``jit(out_shardings=…)`` in
    ``init_params``); ``cfg`` is the built-in model's config, None for a user's model.
    """

    graphdef: Any                 # nnx.GraphDef of the module
    shapes: PyTree                # pure dict of jax.ShapeDtypeStruct
    logical: PyTree               # pure dict of logical-axis tuples (same structure)
    make: Callable[[nnx.Rngs], nnx.Module] = field(compare=False, repr=False, default=None)
    cfg: Optional[ModelConfig] = None


def abstract_module(make_model: Callable[[nnx.Rngs], nnx.Module], seed: int = 0,
                    default: Optional[str] = None, cfg: Optional[ModelConfig] = None
                    ) -> AbstractModel:
    """Describe any Flax NNX model abstractly: shapes, dtypes and logical axes, no memory.

    ``make_model(rngs)`` builds the module; its ``nnx.Param``s carry logical axis names the
    standard Flax way (``nnx.with_partitioning(init, names)`` or
    ``nnx.Param(..., out_sharding=names)``). Eager sharding is off while it is traced, so
    the names are resolved by triax's rules, never read as mesh axes. A parameter without
    names is an error, or replicated when ``default="replicate"``.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> class Scale(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.w = nnx.Param(jnp.ones((4, 8)), out_sharding=("embed", "hidden"))
        >>> abstract_module(Scale).logical
        {'w': ('embed', 'hidden')}
    """
    if default not in (None, "replicate"):
        raise ShardingError(f"default={default!r}: use None (every parameter must name its "
                            f"logical axes) or 'replicate'")
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: make_model(nnx.Rngs(seed)))
    if not isinstance(model, nnx.Module):
        raise ShardingError(f"make_model returned {type(model).__name__}; it must build an "
                            f"nnx.Module from nnx.Rngs")
    graphdef, state = nnx.split(model)
    others = [path_str(p) for p, v in _variables(state) if not isinstance(v, nnx.Param)]
    if others:
        raise ShardingError(f"model state {others[:5]} is not nnx.Param; triax shards and "
                            f"trains parameters only (make them nnx.Param, or keep RNG and "
                            f"statistics state outside the module)")
    shapes = nnx.to_pure_dict(jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state))
    logical = {}
    for path, v in _variables(state):
        axes = _logical_axes(v, path_str(path), default)
        node = logical
        keys = [_key(k) for k in path]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = axes
    return AbstractModel(graphdef, shapes, logical, make_model, cfg)


def abstract_model(cfg: ModelConfig, seed: int = 0) -> AbstractModel:
    """The built-in decoder: one user of :func:`abstract_module`."""
    return abstract_module(functools.partial(Transformer, cfg), seed, cfg=cfg)


def _variables(state):
    return jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]


def _key(k):
    return getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))


def _logical_axes(v: nnx.Variable, where: str, default: Optional[str]) -> tuple:
    names = v.get_metadata().get("out_sharding")
    if names is None:
        names = v.get_metadata().get("sharding_names")
    if names is None:
        if default == "replicate":
            return (None,) * len(v.shape)
        raise ShardingError(
            f"parameter {where!r} {tuple(v.shape)} has no logical axis names; annotate it "
            f"(nnx.with_partitioning(init, (\"embed\", ...)) on its initializer, or "
            f"nnx.Param(value, out_sharding=(...))), or pass default=\"replicate\"")
    names = tuple(names)
    if len(names) != len(v.shape):
        raise ShardingError(f"parameter {where!r} has shape {tuple(v.shape)} but "
                            f"{len(names)} logical names {names}; give one name (or None) "
                            f"per dimension")
    return names


def _to_plain(tree):
    if isinstance(tree, nnx.State) or hasattr(tree, "to_pure_dict"):
        tree = tree.to_pure_dict()
    if isinstance(tree, dict):
        return {k: _to_plain(v) for k, v in tree.items()}
    if isinstance(tree, nnx.Variable):
        return tree[...]
    return tree


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def specs_for(rules: Rules, logical: PyTree, shapes: PyTree, mesh: Mesh) -> PyTree:
    sizes = mesh_sizes(mesh)
    unknown = {}   # every unknown name at once, so one run shows the whole fix
    for path, axes in jax.tree_util.tree_flatten_with_path(logical, is_leaf=_is_axes)[0]:
        for name in axes:
            if name is not None and name not in rules.names:
                unknown.setdefault(name, f"parameter {path_str(path)!r}")
    if unknown:
        raise rules.unknown_names_error(unknown)
    return jax.tree_util.tree_map_with_path(
        lambda path, ax, sd: rules.spec(ax, sd.shape, sizes, what=f"parameter {path_str(path)!r}"),
        logical, shapes, is_leaf=_is_axes)


def param_shardings(am: AbstractModel, mesh: Mesh, strategy: str | Strategy,
                    optimizer: bool = False) -> PyTree:
    """``NamedSharding`` per parameter (``optimizer=True``: the optimizer-state rules)."""
    st = get_strategy(strategy)
    if am.cfg is not None:
        check_expert_mesh(am.cfg, mesh, st.rules)
    rules = st.optimizer_rules if optimizer else st.rules
    specs = specs_for(rules, am.logical, am.shapes, mesh)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
    if st.fsdp and not optimizer:
        check_sufficiently_sharded(am, shardings, mesh)
    return shardings


def check_sufficiently_sharded(am: AbstractModel, shardings: PyTree, mesh: Mesh,
                               tolerance: float = 0.02) -> None:
    """Under FSDP, at most ``tolerance`` of the parameter bytes may stay fully replicated
    (cf. MaxText's "sufficiently sharded" check); the error names the largest offenders.
    LoRA adapters are left out: small, and replicated over their rank by design."""
    if mesh.size == 1:
        return
    total = 0
    replicated = []
    for (path, sd), sh in zip(jax.tree_util.tree_flatten_with_path(am.shapes)[0],
                              jax.tree.leaves(shardings)):
        if is_adapter_path(path):
            continue
        size = int(np.prod(sd.shape)) * sd.dtype.itemsize
        total += size
        if tuple(sh.shard_shape(sd.shape)) == tuple(sd.shape):
            replicated.append((size, path_str(path), tuple(sd.shape)))
    rep_bytes = sum(r[0] for r in replicated)
    if total and rep_bytes / total > tolerance:
        worst = ", ".join(f"{p} {s}" for _, p, s in sorted(replicated, reverse=True)[:5])
        raise ShardingError(
            f"FSDP rules leave {rep_bytes / total:.1%} of parameter bytes fully replicated "
            f"(tolerance {tolerance:.0%}), e.g. {worst}; map one of their logical axes to "
            f"'data' in the rules")


def activation_constraint(mesh: Mesh, rules: Rules) -> Callable:
    sizes = mesh_sizes(mesh)

    def fn(x, logical_axes):
        if jax.sharding.get_abstract_mesh().manual_axes:
            # Inside a shard_map (context attention, the pipeline): the constraint names the
            # whole mesh, which is wrong there. A custom_vjp rule (ring, blockwise) is traced
            # lazily, after the shard_map's own ``using(constraint=None)`` has been left.
            return x
        spec = rules.spec(logical_axes, x.shape, sizes, what="activation")
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return fn


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, strategy: str | Strategy,
                        context_layout: Optional[str] = None):
    """While tracing, resolve the model's logical activation axes through ``strategy``;
    ``context_layout``: the tokens' layout along a ``context``-split sequence
    (``sharding.context.context_attention``; None: any order)."""
    strategy = get_strategy(strategy)
    rules = strategy.rules
    gather, scatter = collective_matmuls(mesh, rules) if strategy.tp_overlap else (None, None)
    with runtime.using(constraint=activation_constraint(mesh, rules),
                       moe_runner=expert_runner(mesh, rules),
                       attention=context_attention(mesh, rules, strategy.context_attention,
                                                   context_layout),
                       gather_matmul=gather, matmul_scatter=scatter):
        yield


def init_params(am: AbstractModel, mesh: Mesh, strategy: str | Strategy, seed: int = 0,
                dtype=None) -> PyTree:
    """Create parameters already sharded: each device only materialises its shard. The
    built-in model's init is one jitted program per (config, mesh, strategy, dtype), its
    seed an input: initialising that model again on that layout (another seed, engine or
    replica) traces and compiles nothing."""
    key = (am.cfg, mesh, get_strategy(strategy), dtype)
    if am.cfg is not None and _hashable(key):
        return _init_program(*key)(seed)
    return jax.jit(init_fn(am, seed, dtype), out_shardings=param_shardings(am, mesh, strategy))()


def _hashable(key) -> bool:
    try:
        hash(key)
    except TypeError:   # a user's strategy with unhashable parts: jitted per call
        return False
    return True


@functools.lru_cache(maxsize=32)
def _init_program(cfg: ModelConfig, mesh: Mesh, strategy: Strategy, dtype) -> Callable:
    """``seed -> params`` for the built-in model of ``cfg`` (its ``make`` is ``Transformer``
    of ``cfg``, so the config names the init), sharded on ``mesh``."""
    am = abstract_model(cfg)

    def init(seed):
        return init_fn(am, seed, dtype)()
    return jax.jit(init, out_shardings=param_shardings(am, mesh, strategy))


def init_fn(am: AbstractModel, seed: int = 0, dtype=None) -> Callable[[], PyTree]:
    """``() -> params`` (a plain dict): build the module from ``am.make``, keep its params.
    Jit it with ``out_shardings`` so each device materialises only its own shard."""
    def init():
        with nnx.use_eager_sharding(False):
            params = _to_plain(nnx.state(am.make(nnx.Rngs(jax.random.key(seed)))))
        return params if dtype is None else jax.tree.map(lambda x: x.astype(dtype), params)
    return init


def batch_sharding(mesh: Mesh, strategy: str | Strategy, ndim: int = 2) -> NamedSharding:
    rules = get_strategy(strategy).rules
    spec = rules.spec(("batch",) + (None,) * (ndim - 1), None, mesh_sizes(mesh), what="batch")
    return NamedSharding(mesh, spec)
