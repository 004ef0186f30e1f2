"""What the training tick loop's activation buffers take on one stage, priced without
running anything: the schedule's slot counts (``tick_program``) × one chunk's traced
residual shapes (``split_backward.StageBackward``), as ``executor.slot_buffer_bytes`` prices what ``run_ticks`` allocates
them. The planner asks this for every pipelined layout it weighs.

    >>> from triax.models import config
    >>> from triax.models.runtime import ExecConfig
    >>> from triax.pipeline.pipelined import PipelineConfig
    >>> cfg = config.TINY.replace(num_layers=4)
    >>> b = activation_buffer_bytes(cfg, 2, PipelineConfig("1f1b", 4), ExecConfig(), 2, 16)
    >>> sorted(b), b["stash"] > 0, b["slot"]     # even stages: no slot conditional
    (['inbox', 'loop', 'slot', 'stash'], True, 0)
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from triax.memo_on_disk import on_disk
from triax.models import runtime
from triax.models.config import ModelConfig
from triax.models.runtime import ExecConfig
from triax.pipeline.buffers import nbytes
from triax.models.protocol import run_stack
from triax.pipeline.executor import loss_only, slot_buffer_bytes
from triax.pipeline.split_backward import Residuals, SlotInputs, StageBackward, slot_layouts
from triax.pipeline.jaxpr_inline import reads
from triax.pipeline.stage import Stage
from triax.pipeline.stage_inputs import StageInputs
from triax.pipeline.stage_layers import StageLayers
from triax.pipeline.tick_program import compile_program
from triax.sharding.partition import abstract_model

if TYPE_CHECKING:
    from triax.pipeline.pipelined import PipelineConfig


def activation_buffer_bytes(cfg: ModelConfig, stages: int, config: "PipelineConfig",
                            exe: ExecConfig, rows: int, seq_len: int) -> dict[str, int]:
    """Per-stage bytes of the training tick loop's activation buffers (``executor.
    slot_buffer_bytes``): the stash of pullback residuals and the inboxes, for micro-batches of
    ``rows`` sequences of ``seq_len`` tokens on one data shard. Traced abstractly
    (``jax.eval_shape``; nothing is allocated), so it prices a 70B model on a laptop.

    Shapes are the stage's view inside ``shard_map``: whole over ``tensor`` (that axis stays
    automatic; XLA may split some residuals over it, so this is an upper bound there).

    ``loop``: what an op materialises besides the buffers when the chunk's layers run as a
    loop (more than one layer per chunk; XLA inlines a one-trip loop): the loop's stacked
    residuals for one micro-batch, which F's loop emits before they are written into the
    slot and B's loop takes as inputs sliced out of it.

    ``slot``: uneven stages only (``StageLayers.slot_counts``): each layer slot runs in a
    conditional (``models.protocol.run_stack``'s ``lax.cond``, which skips a short stage's
    padded slots), and XLA gives a conditional's results buffers of their own rather than
    writing them into the loop's stack: F's slot returns one layer's residuals for one
    micro-batch beside the stacked ones (B's returns one block's gradient beside the chunk's:
    ``costs.memory``'s grads term). Compiled tiny ``3,1`` on ``data=4,pipe=2``: the slots'
    conditionals return 248,320 B (F) and 147,968 B (B); with the skip switched off they are
    gone and the peak drops by 374,280 B.
    """
    return dict(_buffer_bytes(cfg, stages, config, exe, rows, seq_len))


@functools.lru_cache(maxsize=4096)
def _buffer_bytes(cfg: ModelConfig, stages: int, config: "PipelineConfig", exe: ExecConfig,
                  rows: int, seq_len: int) -> dict[str, int]:
    """``activation_buffer_bytes``, cached: the planner asks the same question for every
    strategy that shares a pipeline layout."""
    schedule = config.build(stages)
    # Uneven stages: every stage's buffers are the longest's (one SPMD program).
    layers = StageLayers(cfg.num_layers, stages, schedule.virtual, counts=config.stage_layers)
    per_chunk, uneven = layers.per_chunk, layers.slot_counts is not None
    cfg = _one_layer(cfg)       # the chunk's traces read the model's layer, not its depth
    inputs, x = _slot_inputs(cfg, per_chunk, exe, rows, seq_len)
    program = _program(schedule)
    layouts = slot_layouts(inputs, schedule.kind.split_backward) \
        if schedule.has_backward else None
    out = slot_buffer_bytes(program, layouts, nbytes(x))
    out["loop"] = _loop_residual_bytes(cfg, per_chunk, exe, rows, seq_len) \
        if per_chunk > 1 and schedule.has_backward else 0
    out["slot"] = _layer_residual_bytes(cfg, exe, rows, seq_len) \
        if uneven and schedule.has_backward else 0
    return out


def _one_layer(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` at one layer: what a chunk's traces are keyed on. A chunk is built from the
    model's per-layer parameters at the chunk's own layer count (``_stage_backward``), so its
    traced shapes are the same at every depth of the model (``tests/test_buffer_sizes.py``),
    and every depth (tiny at 2, 4, 6 or 8 layers, any ``--num-layers``) shares the traces,
    in memory and on disk."""
    return cfg.replace(num_layers=1)


@functools.lru_cache(maxsize=64)
def _abstract(cfg: ModelConfig):
    """``abstract_model(cfg)``, once per model: every probe trace of a model (four chunk
    sizes for the stash, four for the loop, per remat policy) builds its chunk from it, and
    ``nnx.eval_shape`` of a whole model's constructor costs as much as a small trace.
    Read only here (its shapes are mapped, never written)."""
    return abstract_model(cfg)


@functools.lru_cache(maxsize=256)
def _program(schedule):
    # Read only here; the planner prices many batch shapes on each schedule's one program.
    return compile_program(schedule)


def _layer_residual_bytes(cfg: ModelConfig, exe: ExecConfig, rows: int, seq_len: int) -> int:
    """One layer's share of ``loop``: the residuals one layer of the loop keeps for one
    micro-batch (the fit's step from two layers to three)."""
    return _loop_residual_bytes(cfg, 3, exe, rows, seq_len) - \
        _loop_residual_bytes(cfg, 2, exe, rows, seq_len)


# Chunk sizes and micro-batch rows the chunk is traced at (see _slot_inputs).
_PROBE_LAYERS, _PROBE_ROWS = (2, 3), (2, 3)


@functools.lru_cache(maxsize=1024)
def _slot_inputs(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                 seq_len: int) -> tuple[SlotInputs, jax.ShapeDtypeStruct]:
    """One chunk's stash slot inputs (``split_backward.SlotInputs``: the stashed leaves, the
    cut) and its activation, shared by every schedule and micro-batch count with the same
    chunk.

    Tracing a chunk's split backward takes about a second whatever its size, and the planner
    asks for dozens of (layers, rows) pairs. Every stashed leaf's dimensions are constants,
    the chunk's layer count (the layer scan stacks it), the micro-batch rows, or their
    product, so each dimension is bilinear in (layers, rows): four traces at small sizes give
    every pair (``_bilinear``), the same leaves in bytes (one row may fold a size-1
    dimension, which the slot planning ignores: ``tests/test_buffer_sizes.py``). What does
    not fit that form, and a one-layer chunk (it runs unscanned), is traced directly."""
    if per_chunk >= _PROBE_LAYERS[0]:
        probes = {(l, r): _trace_slot_inputs(cfg, l, exe, r, seq_len)
                  for l in _PROBE_LAYERS for r in _PROBE_ROWS}
        if (per_chunk, rows) in probes:
            return probes[(per_chunk, rows)]
        fitted = _bilinear(probes, per_chunk, rows)
        if fitted is not None:
            return fitted
    return _trace_slot_inputs(cfg, per_chunk, exe, rows, seq_len)


def _corners(probes: dict) -> list:
    (l0, l1), (r0, r1) = _PROBE_LAYERS, _PROBE_ROWS
    return [probes[(l0, r0)], probes[(l1, r0)], probes[(l0, r1)], probes[(l1, r1)]]


def _fit(d00: int, d10: int, d01: int, d11: int, layers: int, rows: int) -> int:
    """d(layers, rows) = a + b·layers + c·rows + e·layers·rows through the four probes (on
    the unit-step grid of ``_PROBE_LAYERS`` × ``_PROBE_ROWS``)."""
    dl, dr, dlr = d10 - d00, d01 - d00, d11 - d10 - d01 + d00
    l, r = layers - _PROBE_LAYERS[0], rows - _PROBE_ROWS[0]
    return d00 + dl * l + dr * r + dlr * l * r


def _bilinear(probes: dict, layers: int, rows: int):
    """The probes' shapes at (layers, rows), each dimension fitted by ``_fit``; None where
    the probes differ in anything but shapes (flags, structure, ranks, dtypes)."""
    sds = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    flat = [jax.tree.flatten(c, is_leaf=sds) for c in _corners(probes)]
    if any(f[1] != flat[0][1] for f in flat):
        return None
    leaves = []
    for xs in zip(*(f[0] for f in flat)):
        if not sds(xs[0]):          # a flag: the same at every probe
            if any(x != xs[0] for x in xs):
                return None
            leaves.append(xs[0])
            continue
        if len({len(x.shape) for x in xs}) != 1 or len({x.dtype for x in xs}) != 1:
            return None
        dims = tuple(_fit(*ds, layers, rows) for ds in zip(*(x.shape for x in xs)))
        if min(dims, default=1) < 0:
            return None
        leaves.append(jax.ShapeDtypeStruct(dims, xs[0].dtype))
    return jax.tree.unflatten(flat[0][1], leaves)


@functools.lru_cache(maxsize=256)
@on_disk
def _trace_slot_inputs(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                       seq_len: int) -> tuple[SlotInputs, jax.ShapeDtypeStruct]:
    """``_slot_inputs`` by tracing the chunk's split backward (nothing is allocated)."""
    sb, x = _stage_backward(cfg, per_chunk, exe, rows, seq_len)
    return sb.slot_inputs(), x


def _stage_backward(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                    seq_len: int):
    """One chunk's stash and split backward (``StageBackward``: what F stashes, what B_in
    stashes for W) and its activation, traced abstractly."""
    am = _abstract(cfg)
    sd = jax.ShapeDtypeStruct
    chunk = jax.tree.map(lambda a: sd((per_chunk,) + a.shape[1:], a.dtype), am.shapes["blocks"])
    pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    tokens = sd((rows, seq_len), jnp.int32)
    inputs = {"inputs": tokens, "targets": tokens, "weights": sd((rows, seq_len), jnp.float32)}
    consts = {"inv_total_weight": sd((), jnp.float32), "aux_scale": sd((), jnp.float32)}
    extras = StageInputs(inputs, consts, sd((), jnp.bool_), sd((), jnp.bool_),
                         sd((per_chunk,), jnp.int32))
    stage = Stage(am.graphdef, exe, "loss")
    x = sd(stage.activation(chunk, pieces, inputs).shape, exe.dtype)
    with runtime.using(constraint=None):
        sb = StageBackward.trace(loss_only(stage), chunk, pieces, x, extras)
    return sb, x


@functools.lru_cache(maxsize=1024)
def _loop_residual_bytes(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                         seq_len: int) -> int:
    """``_trace_loop_bytes``, fitted bilinearly in (layers, rows) from four small traces as
    ``_slot_inputs`` is (a sum of leaves that are each bilinear)."""
    probes = {(l, r): _trace_loop_bytes(cfg, l, exe, r, seq_len)
              for l in _PROBE_LAYERS for r in _PROBE_ROWS}
    return _fit(*_corners(probes), per_chunk, rows)


@functools.lru_cache(maxsize=256)
@on_disk
def _trace_loop_bytes(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                      seq_len: int) -> int:
    """Bytes of the residuals one chunk's layer loop (``run_stack``'s scan) stacks for one
    micro-batch: the stash's share that the loop itself emits (the embedding's and the
    head's residuals come from the stage's conditionals, outside it), those its pullback
    reads (XLA drops the rest from the loop). Traced abstractly."""
    am = _abstract(cfg)
    sd = jax.ShapeDtypeStruct
    chunk = jax.tree.map(lambda a: sd((per_chunk,) + a.shape[1:], a.dtype), am.shapes["blocks"])
    pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    stage = Stage(am.graphdef, exe, "loss")
    tokens = sd((rows, seq_len), jnp.int32)
    x = sd(stage.activation(chunk, pieces, {"inputs": tokens}).shape, exe.dtype)

    def blocks(chunk, pieces, x, extras):
        y, aux, _ = run_stack(stage.model(chunk, pieces), x, {"inputs": tokens}, exe)
        return y, aux
    with runtime.using(constraint=None):
        res = Residuals.trace(blocks, chunk, pieces, x, ())   # its outputs' shapes: res.out
        read = reads(lambda stored, c, p, ct: res.pullback(stored, c, p)(ct),
                     list(res.shapes), chunk, pieces, res.out)
    return sum(nbytes(s) for s, r in zip(res.shapes, read) if r)
