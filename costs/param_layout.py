"""Where the parameters live: the model's real parameter tree (``sharding.partition.
abstract_model``: shapes and logical axes, no allocation), each leaf resolved through the
strategy's rules for the given mesh sizes, as ``param_shardings`` does, without needing that
many devices. A ``--params N`` estimate (no config) shards the whole count over the axes
that would hold it.

    >>> from triax.models import config
    >>> from triax.costs.workload import Layout, Workload
    >>> w = Workload.of(config.get("tiny"), train=True, dtype="fp32", batch=8, seq=16)
    >>> local_param_elements(w, Layout(data=8)) == config.get("tiny").num_params
    True
"""
from __future__ import annotations

import functools
from typing import Optional

import jax

from triax.choices import PRECISIONS
from triax.models.config import ModelConfig
from triax.models.quantize import served_dtype
from triax.models.lora import is_adapter_path
from triax.pipeline.stage_layers import StageLayers, pipeline_strategy
from triax.costs.workload import Layout, Workload, ceil_div, prod
from triax.sharding.partition import abstract_model, path_str
from triax.sharding.rules import Rules

Leaf = tuple[str, tuple[int, ...], tuple]   # (path, shape, logical axes)


@functools.lru_cache(maxsize=32)
def param_leaves(cfg: ModelConfig) -> tuple[Leaf, ...]:
    """(path, shape, logical axes) for every parameter of the real model."""
    am = abstract_model(cfg)
    flat = jax.tree_util.tree_flatten_with_path(am.shapes)[0]
    logical = jax.tree.leaves(am.logical, is_leaf=lambda x: isinstance(x, tuple))
    return tuple((path_str(p), tuple(s.shape), tuple(l)) for (p, s), l in zip(flat, logical))


def stored_leaves(w: Workload, lay: Layout) -> tuple[Leaf, ...]:
    """:func:`param_leaves` as the step stores them: under uneven pipeline stages the blocks'
    stack is ``StageLayers.stored_layers`` long (stage by stage, padded to the longest)."""
    return _restacked(w.cfg, _stored_layers(w, lay))


@functools.lru_cache(maxsize=32)
def _restacked(cfg: ModelConfig, layers: Optional[int]) -> tuple[Leaf, ...]:
    """:func:`param_leaves` with the blocks' stack ``layers`` long (None: as the model has
    it)."""
    leaves = param_leaves(cfg)
    if layers is None:
        return leaves
    return tuple((p, (layers,) + s[1:] if p.startswith("blocks/") else s, l)
                 for p, s, l in leaves)


def local_base_bytes(w: Workload, lay: Layout) -> int:
    """Per-device bytes of the frozen LoRA base, each leaf in its own dtype (an int8 base
    keeps fp32 scales, embeddings and norms beside its int8 projections)."""
    rules, size = layout_rules(w, lay), _itemsizes(w.cfg)
    return sum(local_elements(s, l, rules, lay.sizes) * size[p]
               for p, s, l in stored_leaves(w, lay) if not is_adapter_path(p.split("/")))


def local_served_bytes(w: Workload, lay: Layout) -> int:
    """Per-device bytes of the weights as an engine serves them in ``w.dtype``: each leaf in
    its served dtype (``models.quantize.served_dtype``: int8 projections and their scales
    as ``--quantize int8`` stores them, the float leaves in ``w.dtype``)."""
    rules, dtype, dtypes = layout_rules(w, lay), PRECISIONS[w.dtype], _dtypes(w.cfg)
    return sum(local_elements(s, l, rules, lay.sizes) * served_dtype(dtypes[p], dtype).itemsize
               for p, s, l in stored_leaves(w, lay))


@functools.lru_cache(maxsize=32)
def _dtypes(cfg: ModelConfig) -> dict[str, object]:
    flat = jax.tree_util.tree_flatten_with_path(abstract_model(cfg).shapes)[0]
    return {path_str(p): s.dtype for p, s in flat}


def _itemsizes(cfg: ModelConfig) -> dict[str, int]:
    return {p: d.itemsize for p, d in _dtypes(cfg).items()}


def local_elements(shape, logical, rules: Rules, sizes: dict[str, int]) -> int:
    """Elements of one parameter on one device: its shape divided as ``Rules.spec`` places
    it on a mesh of ``sizes`` (the placement the step compiles with)."""
    return _local_elements(tuple(shape), tuple(logical), rules, _items(sizes))


@functools.lru_cache(maxsize=1 << 16)   # the search asks the same leaf on the same mesh often
def _local_elements(shape, logical, rules: Rules, items) -> int:
    sizes = dict(items)
    spec = rules.spec(logical, shape, sizes)
    n = 1
    for i, dim in enumerate(shape):
        e = spec[i] if i < len(spec) else None
        n *= dim // prod(sizes[a] for a in ((e,) if isinstance(e, str) else e or ()))
    return n


def layout_rules(w: Workload, lay: Layout, optimizer: bool = False) -> Rules:
    """The rules the step places parameters with: the strategy's, as the pipeline adapts
    them for ``pipe`` (``pipeline_strategy``: an uneven layer count keeps every layer on
    every stage; uneven stages split their stage-ordered stack, :func:`stored_leaves`)."""
    st = lay.strategy
    if lay.pipe > 1 and w.cfg is not None:
        st = pipeline_strategy(st, w.cfg.num_layers, lay.pipe, lay.stage_layers)
    return st.optimizer_rules if optimizer else st.rules


def local_param_elements(w: Workload, lay: Layout, optimizer: bool = False,
                         part: Optional[str] = None) -> int:
    """Per-device parameter elements under the strategy's (or optimizer's) rules; ``part``
    "adapters" or "base" counts only the LoRA adapters or only the frozen base."""
    rules = layout_rules(w, lay, optimizer)
    if w.cfg is None:   # quick estimate: shard the count over the axes that would hold it
        shards = lay.pipe
        if "tensor" in rules.mesh_axes("mlp"):
            shards *= lay.tensor
        if "data" in rules.mesh_axes("embed"):
            shards *= lay.data
        return ceil_div(w.params, shards)
    return _param_sum(w.cfg, rules, _items(lay.sizes), _stored_layers(w, lay), part)


@functools.lru_cache(maxsize=4096)
def _param_sum(cfg: ModelConfig, rules: Rules, items, layers: Optional[int],
               part: Optional[str]) -> int:
    """``local_param_elements``' sum, once per (model, rules, mesh, stack, part): the search
    asks it of every candidate, and candidates that differ only in schedule, micro-batches,
    context scheme or overlap share it."""
    elems = _leaf_elements(cfg, rules, items, layers)
    return sum(elems[i] for i, (p, _, _) in enumerate(param_leaves(cfg))
               if part is None or (part == "adapters") == is_adapter_path(p.split("/")))


class LeafElements:
    """:func:`local_elements` of each :func:`param_leaves` leaf (by index) on one mesh under
    one rules table, each resolved when first read and then kept: the planner's memory and
    traffic terms read the leaves of every candidate layout, and many candidates share
    (rules, mesh). A leaf nobody reads is never resolved, so one that cannot split raises
    its ``ShardingError`` only where it is read, as ``local_elements`` does."""

    def __init__(self, leaves: tuple[Leaf, ...], rules: Rules, items: tuple):
        self._leaves, self._rules, self._items = leaves, rules, items
        self._got: list[Optional[int]] = [None] * len(leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    def __getitem__(self, i: int) -> int:
        got = self._got[i]
        if got is None:
            _, shape, logical = self._leaves[i]
            got = self._got[i] = _local_elements(shape, logical, self._rules, self._items)
        return got


def leaf_elements(cfg: ModelConfig, rules: Rules, sizes: dict[str, int]) -> LeafElements:
    """The local elements of ``param_leaves(cfg)``'s leaves on a mesh of ``sizes`` under
    ``rules`` (index as the leaves; read only what is needed: :class:`LeafElements`)."""
    return _leaf_elements(cfg, rules, _items(sizes), None)


def block_elements(cfg: ModelConfig, rules: Rules, sizes: dict[str, int]) -> int:
    """One layer of the blocks' stack on one device (each ``blocks/`` leaf without its
    ``layers`` dimension): a block's weights or its gradient."""
    return _block_elements(cfg, rules, _items(sizes))


@functools.lru_cache(maxsize=4096)
def _block_elements(cfg: ModelConfig, rules: Rules, items) -> int:
    return sum(_local_elements(s[1:], l[1:], rules, items)
               for p, s, l in param_leaves(cfg) if p.startswith("blocks/"))


@functools.lru_cache(maxsize=4096)
def _leaf_elements(cfg: ModelConfig, rules: Rules, items, layers: Optional[int]
                   ) -> LeafElements:
    """``layers``: the blocks' stack stored that long (:func:`stored_leaves`), None as the
    model has it."""
    return LeafElements(_restacked(cfg, layers), rules, items)


def _items(sizes: dict[str, int]) -> tuple:
    return tuple(sorted(sizes.items()))


def _stored_layers(w: Workload, lay: Layout) -> Optional[int]:
    """The blocks' stored stack length under pipeline stages (:func:`stored_leaves`); None
    unpipelined (the model's own)."""
    if lay.pipe == 1:
        return None
    return StageLayers(w.cfg.num_layers, lay.pipe, lay.virtual,
                       counts=lay.stage_layers).stored_layers
