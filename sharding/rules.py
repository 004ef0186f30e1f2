"""Logical axis names → mesh axes: one rules table, and the strategy presets built from it.

Logical names (parameters): ``embed, heads, kv_heads, head_dim, mlp, vocab, layers, experts``.
Logical names (activations): ``batch, seq, res_seq, act_embed, act_heads, act_kv_heads,
act_mlp, act_vocab, act_experts``. ``res_seq`` is the sequence dimension of the residual
stream (norms, residual adds, the embedding output): replicated over ``tensor`` except under
the sequence-parallel strategies (``tp_sp``, ``fsdp_tp_sp``), which split it. Activations get names of their own so that, e.g., FSDP can shard a
weight's ``embed`` dimension over ``data`` while the activation's batch already uses ``data``.

A strategy is nothing but a choice of rules::

    >>> from triax.sharding import rules
    >>> rules.get_strategy("tp").rules.mesh_axes("mlp")
    ('tensor',)
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from jax.sharding import PartitionSpec as P

from triax.mesh.build import AXES as MESH_AXES

MeshAxes = Union[None, str, tuple[str, ...]]

# ``lora_rank`` (an adapter's rank, models.lora) and ``adapter_slots`` (a serving table's
# adapters, models.lora_table) are in no table: replicated everywhere.
PARAM_AXES = ("embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "experts",
              "expert_mlp", "norm", "lora_rank", "adapter_slots")
ACTIVATION_AXES = ("batch", "seq", "res_seq", "kv_seq", "act_embed", "act_heads", "act_kv_heads",
                   "act_head_dim", "act_mlp", "act_vocab", "act_experts", "capacity",
                   "kv_blocks")
LOGICAL_AXES = PARAM_AXES + ACTIVATION_AXES

# Logical axes whose sharding degrades to replication when the mesh axis is larger than the
# dimension (Megatron replicates KV heads across the extra tensor ranks instead of refusing).
# Likewise the sequence over `context` or `tensor` for a sequence shorter than the axis or not
# divisible by it (decode's one token, a short prompt): those steps run on the whole sequence.
REPLICABLE = frozenset({"kv_heads", "act_kv_heads", "seq", "res_seq"})


class ShardingError(ValueError):
    """A rules table, a parameter or a mesh that cannot be combined; the message says the fix."""


def split_pieces(name: str, size: int, axes: Sequence[str], n: int, what: str = "array",
                 dim: int = 0) -> int:
    """How many pieces a dimension of ``size`` named ``name`` is cut into over mesh ``axes``
    (``n`` devices in all): ``n`` where that divides it, 1 (replicated) for a ``REPLICABLE``
    name where it does not, else a ShardingError naming the fix (``what``'s dimension
    ``dim``). ``Rules.spec`` and the planner both ask this."""
    if size % n == 0:
        return n
    if name in REPLICABLE:
        return 1
    raise ShardingError(
        f"{what}: dimension {dim} ({name!r}, size {size}) is not divisible "
        f"by mesh axes {tuple(axes)} of size {n}; choose a mesh whose {'×'.join(axes)} "
        f"divides {size}, or map {name!r} elsewhere in the rules")


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclass(frozen=True)
class Rules:
    """An immutable logical-name → mesh-axes table (hashable, so jit caches stay stable)."""

    table: tuple[tuple[str, tuple[str, ...]], ...]
    user_names: frozenset = frozenset()   # logical names a user's model added (see extend)

    @classmethod
    def of(cls, mapping: Mapping[str, MeshAxes]) -> "Rules":
        unknown = sorted(set(mapping) - set(LOGICAL_AXES))
        if unknown:
            raise ShardingError(f"unknown logical axis name(s) {unknown} in rules; known names: "
                                f"{', '.join(LOGICAL_AXES)}")
        return cls(tuple(sorted((k, _as_tuple(v)) for k, v in mapping.items())))

    @property
    def names(self) -> tuple[str, ...]:
        """Every logical name this table resolves: triax's own plus the user's."""
        return LOGICAL_AXES + tuple(sorted(self.user_names))

    def as_dict(self) -> dict[str, tuple[str, ...]]:
        return dict(self.table)

    @functools.cached_property
    def _lookup(self) -> dict[str, tuple[str, ...]]:
        # ``table`` as a dict, built once: the planner asks ``mesh_axes`` of every leaf of
        # every candidate layout. Read only here (``as_dict`` hands out copies).
        return dict(self.table)

    def mesh_axes(self, logical: Optional[str]) -> tuple[str, ...]:
        if logical is None:
            return ()
        if logical not in LOGICAL_AXES and logical not in self.user_names:
            raise self.unknown_names_error({logical: None})
        return self._lookup.get(logical, ())

    def split_axes(self, logical: str, sizes: Mapping[str, int]) -> tuple[str, ...]:
        """The mesh axes (size > 1 in ``sizes``) that ``logical`` is split over."""
        return tuple(a for a in self.mesh_axes(logical) if sizes.get(a, 1) > 1)

    def split_size(self, logical: str, sizes: Mapping[str, int]) -> int:
        """How many pieces ``logical`` is split into on a mesh of ``sizes``."""
        n = 1
        for a in self.split_axes(logical, sizes):
            n *= sizes[a]
        return n

    def local_size(self, logical: str, size: int, sizes: Mapping[str, int]) -> int:
        """A dimension of ``size`` named ``logical`` on one device, as :meth:`spec` places it
        on a mesh of ``sizes``: divided by its split, whole for a ``REPLICABLE`` name the
        split does not divide (KV heads beyond ``tensor``); any other name that does not
        divide raises ShardingError (query heads, the MLP width).

            >>> from triax.sharding.rules import get_strategy
            >>> r = get_strategy("tp").rules
            >>> r.local_size("act_heads", 8, {"tensor": 4}), r.local_size("act_kv_heads", 2, {"tensor": 4})
            (2, 2)
            >>> r.local_size("act_heads", 6, {"tensor": 4})
            Traceback (most recent call last):
            ...
            triax.sharding.rules.ShardingError: act_heads: dimension 0 ('act_heads', size 6) is not divisible by mesh axes ('tensor',) of size 4; choose a mesh whose tensor divides 6, or map 'act_heads' elsewhere in the rules
        """
        axes = self.split_axes(logical, sizes)
        n = self.split_size(logical, sizes)
        return size // split_pieces(logical, size, axes, n, logical)

    def splits_over(self, logical_axes: Sequence[Optional[str]], shape: Sequence[int],
                    sizes: Mapping[str, int], mesh_axis: str) -> bool:
        """Whether an array (``logical_axes``, ``shape``), placed by :meth:`spec` on a mesh of
        ``sizes``, is split over ``mesh_axis`` (a ``REPLICABLE`` dimension the axis does not
        divide is whole).

            >>> from triax.sharding.rules import get_strategy
            >>> r = get_strategy("tp").rules
            >>> r.splits_over(("kv_heads", "head_dim"), (2, 8), {"tensor": 2}, "tensor")
            True
            >>> r.splits_over(("kv_heads", "head_dim"), (2, 8), {"tensor": 4}, "tensor")
            False
        """
        return any(mesh_axis in _as_tuple(e) for e in self.spec(logical_axes, shape, sizes))

    def unknown_names_error(self, where: Mapping[str, Optional[str]]) -> ShardingError:
        """One error for every unknown name (``{name: where it was met}``), with the fix."""
        names = sorted(where)
        met = ", ".join(f"{n!r}" + (f" (in {where[n]})" if where[n] else "") for n in names)
        plural = "s" if len(names) > 1 else ""
        n0 = names[0]
        return ShardingError(
            f"unknown logical axis name{plural} {met}; known names: {', '.join(self.names)}. "
            f"Add a rule for {'each' if plural else 'it'}, e.g. rules={{{n0!r}: 'tensor'}} "
            f"(a mesh axis), {{{n0!r}: 'embed'}} (follow a known name) or {{{n0!r}: None}} "
            f"(replicate)")

    def replace(self, **updates: MeshAxes) -> "Rules":
        unknown = sorted(set(updates) - set(self.names))
        if unknown:
            raise ShardingError(f"unknown logical axis name(s) {unknown} in rules; known names: "
                                f"{', '.join(self.names)} (new names go through extend)")
        d = self.as_dict()
        d.update({k: _as_tuple(v) for k, v in updates.items()})
        return Rules(tuple(sorted(d.items())), self.user_names)

    def extend(self, mapping: Mapping[str, MeshAxes]) -> "Rules":
        """Add or override rules, new logical names allowed (a user's own model).

        A value is ``None`` (replicate), mesh axes (``"tensor"``, ``("expert", "data")``), or
        a logical name this table already resolves, which the new name then follows — so
        ``{"channels": "embed"}`` shards like ``embed`` under every preset (over ``data`` for
        FSDP, not at all for DP).

            >>> from triax.sharding.rules import get_strategy
            >>> r = get_strategy("fsdp").rules.extend({"channels": "embed", "patch": None})
            >>> r.mesh_axes("channels"), r.mesh_axes("patch")
            (('data',), ())
        """
        d = self.as_dict()
        new = set()
        for name, value in mapping.items():
            if not isinstance(name, str) or not name:
                raise ShardingError(f"rule key {name!r}: logical names are non-empty strings")
            if isinstance(value, str) and value not in MESH_AXES:
                if value not in self.names:
                    raise ShardingError(
                        f"rule {name!r}: {value!r} is neither a mesh axis ({', '.join(MESH_AXES)}) "
                        f"nor a known logical name ({', '.join(self.names)})")
                d[name] = self.mesh_axes(value)
            else:
                bad = [a for a in _as_tuple(value) if a not in MESH_AXES]
                if bad:
                    raise ShardingError(f"rule {name!r}: {bad} are not mesh axes; use "
                                        f"{', '.join(MESH_AXES)}, a logical name, or None")
                d[name] = _as_tuple(value)
            if name not in LOGICAL_AXES:
                new.add(name)
        return Rules(tuple(sorted(d.items())), self.user_names | new)

    def spec(self, logical_axes: Sequence[Optional[str]], shape: Sequence[int] | None = None,
             mesh_shape: Mapping[str, int] | None = None, what: str = "array") -> P:
        """Resolve logical axes to a ``PartitionSpec``, validating against shape and mesh.

        Mesh axes of size 1 are dropped (they shard nothing); a ``REPLICABLE`` axis that
        does not divide falls back to replication.
        """
        used: dict[str, str] = {}
        out = []
        unknown = {n: what for n in logical_axes if n is not None and n not in self.names}
        if unknown:   # name the array in the error
            raise self.unknown_names_error(unknown)
        for i, name in enumerate(logical_axes):
            axes = tuple(a for a in self.mesh_axes(name)
                         if mesh_shape is None or mesh_shape.get(a, 1) > 1)
            if mesh_shape is not None:
                missing = [a for a in self.mesh_axes(name) if a not in mesh_shape]
                if missing:
                    raise ShardingError(f"{what}: rules map {name!r} to mesh axis {missing} "
                                        f"which the mesh {dict(mesh_shape)} does not have")
            for a in axes:
                if a in used:
                    raise ShardingError(
                        f"{what}: mesh axis {a!r} used twice in one array (by logical axes "
                        f"{used[a]!r} and {name!r}); map one of them elsewhere in the rules")
                used[a] = name
            if axes and shape is not None and mesh_shape is not None:
                n = 1
                for a in axes:
                    n *= mesh_shape[a]
                if split_pieces(name, shape[i], axes, n, what, i) == 1:   # replicated
                    for a in axes:
                        used.pop(a)
                    axes = ()
            out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
        while out and out[-1] is None:
            out.pop()
        return P(*out)


class StrategyKind(enum.Enum):
    DP = "dp"
    FSDP = "fsdp"
    ZERO1 = "zero1"
    TP = "tp"
    FSDP_TP = "fsdp_tp"
    TP_SP = "tp_sp"
    FSDP_TP_SP = "fsdp_tp_sp"


@dataclass(frozen=True)
class Strategy:
    """A parallelism strategy: the rules for parameters/activations and for optimizer state.

    ``optimizer_rules`` differs from ``rules`` only for ZeRO-1 (replicated parameters,
    sharded optimizer state). Every preset also carries the pipeline's and the experts'
    rules (``_PIPE``, ``_EXPERT``: layers over ``pipe``, experts over ``expert``), so both
    compose with every base strategy; on a mesh without those axes they split nothing.
    """

    name: str
    rules: Rules
    optimizer_rules: Rules
    fsdp: bool = False  # parameters sharded over `data` (enables the "sufficiently sharded" check)
    context_attention: str = "all-gather"   # attention across `context`: all-gather | ring
    tp_overlap: bool = False   # SP's projections as collective matmuls (sharding.collective_matmul)

    def with_updates(self, **updates: MeshAxes) -> "Strategy":
        """This strategy with ``logical name=mesh axes`` rules added (parameters and optimizer)."""
        return dataclasses.replace(self, rules=self.rules.replace(**updates),
                                   optimizer_rules=self.optimizer_rules.replace(**updates))

    def with_rules(self, mapping: Optional[Mapping[str, MeshAxes]]) -> "Strategy":
        """This preset plus a user's rules (new logical names allowed; see ``Rules.extend``)."""
        if not mapping:
            return self
        return dataclasses.replace(self, rules=self.rules.extend(mapping),
                                   optimizer_rules=self.optimizer_rules.extend(mapping))


# The expert axis is a data axis for everything but the experts (whose all-to-all needs the
# tokens split over it); expert-major so each expert rank holds one contiguous batch block.
# `replica` (HSDP) is a batch axis that no parameter rule names: FSDP shards the weights
# over `data` within each replica group and keeps one copy per group, so its gathers and
# reduce-scatters stay in the group and only one all-reduce of the shard crosses groups.
# Replica-major, outermost like its place in the mesh.
_BATCH = {"batch": ("replica", "expert", "data")}
_TP = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor",
       "expert_mlp": "tensor",
       "act_heads": "tensor", "act_kv_heads": "tensor", "act_mlp": "tensor",
       "act_vocab": "tensor"}
_FSDP = {"embed": "data"}
# Pipeline: stacked layers split over `pipe`. Experts: over `expert` (weights and dispatch).
_PIPE = {"layers": "pipe"}
_EXPERT = {"experts": "expert", "act_experts": "expert"}
# Context parallelism: the activations' sequence over `context` (a size-1 axis splits
# nothing), the residual stream's too; K/V caches and gathered keys (`kv_seq`) stay whole.
_CONTEXT = {"seq": "context", "res_seq": "context"}
# Megatron sequence parallelism: the residual stream outside the column/row matmul pairs is
# split over `tensor` along the sequence (within its `context` chunk), so XLA turns each
# row-parallel all-reduce into a reduce-scatter and gathers the sequence again before the
# next column-parallel matmul.
_SP = {"res_seq": ("context", "tensor")}
# A sequence-parallel strategy is its tensor-parallel base plus _SP.
SP_BASE = {StrategyKind.TP_SP: StrategyKind.TP, StrategyKind.FSDP_TP_SP: StrategyKind.FSDP_TP}


def _strategy(kind: StrategyKind) -> Strategy:
    if kind in SP_BASE:
        return dataclasses.replace(_strategy(SP_BASE[kind]).with_updates(**_SP), name=kind.value)
    base = {**_BATCH, **_PIPE, **_EXPERT, **_CONTEXT}
    if kind is StrategyKind.DP:
        r = Rules.of(base)
        return Strategy(kind.value, r, r)
    if kind is StrategyKind.FSDP:
        r = Rules.of({**base, **_FSDP})
        return Strategy(kind.value, r, r, fsdp=True)
    if kind is StrategyKind.ZERO1:
        r = Rules.of(base)
        return Strategy(kind.value, r, Rules.of({**base, **_FSDP}))
    if kind is StrategyKind.TP:
        r = Rules.of({**base, **_TP})
        return Strategy(kind.value, r, r)
    if kind is StrategyKind.FSDP_TP:
        r = Rules.of({**base, **_TP, **_FSDP})
        return Strategy(kind.value, r, r, fsdp=True)
    raise AssertionError(kind)


STRATEGIES: dict[str, Strategy] = {k.value: _strategy(k) for k in StrategyKind}


def get_strategy(name: str | Strategy) -> Strategy:
    """Look up a preset by name (``dp, fsdp, zero1, tp, fsdp_tp, tp_sp, fsdp_tp_sp``)."""
    if isinstance(name, Strategy):
        return name
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ShardingError(f"unknown strategy {name!r}; choose one of: "
                            f"{', '.join(STRATEGIES)}") from None
