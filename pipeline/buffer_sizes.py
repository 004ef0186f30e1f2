"""What the training tick loop's activation buffers take on one stage, priced without
running anything: the schedule's slot counts (``tick_program``) × one chunk's traced
residual shapes (``split_backward.StageBackward``), as ``executor.buffer_bytes`` allocates
them. The planner asks this for every pipelined layout it weighs.

    >>> from triax.models import config
    >>> from triax.models.layers import ExecConfig
    >>> from triax.pipeline.runner import PipelineConfig
    >>> cfg = config.TINY.replace(num_layers=4)
    >>> b = activation_buffer_bytes(cfg, 2, PipelineConfig("1f1b", 4), ExecConfig(), 2, 16)
    >>> sorted(b), b["stash"] > 0
    (['inbox', 'loop', 'stash'], True)
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from triax.models.axes import using_constraint
from triax.models.config import ModelConfig
from triax.models.layers import ExecConfig
from triax.pipeline.executor import buffer_bytes, loss_only
from triax.pipeline.split_backward import StageBackward
from triax.pipeline.jaxpr_split import reads
from triax.pipeline.stage import Residuals, Stage
from triax.pipeline.stage_layers import StageLayers
from triax.pipeline.tick_program import compile_program
from triax.sharding.partition import abstract_model

if TYPE_CHECKING:
    from triax.pipeline.runner import PipelineConfig


def activation_buffer_bytes(cfg: ModelConfig, stages: int, config: "PipelineConfig",
                            exe: ExecConfig, rows: int, seq_len: int) -> dict[str, int]:
    """Per-stage bytes of the training tick loop's activation buffers (``executor.
    buffer_bytes``): the stash of pullback residuals and the inboxes, for micro-batches of
    ``rows`` sequences of ``seq_len`` tokens on one data shard. Traced abstractly
    (``jax.eval_shape``; nothing is allocated), so it prices a 70B model on a laptop.

    Shapes are the stage's view inside ``shard_map``: whole over ``tensor`` (that axis stays
    automatic; XLA may split some residuals over it, so this is an upper bound there).

    ``loop``: what an op materialises besides the buffers when the chunk's layers run as a
    loop (more than one layer per chunk; XLA inlines a one-trip loop): the loop's stacked
    residuals for one micro-batch, which F's loop emits before they are written into the
    slot and B's loop takes as inputs sliced out of it.
    """
    return dict(_buffer_bytes(cfg, stages, config, exe, rows, seq_len))


@functools.lru_cache(maxsize=4096)
def _buffer_bytes(cfg: ModelConfig, stages: int, config: "PipelineConfig", exe: ExecConfig,
                  rows: int, seq_len: int) -> dict[str, int]:
    """``activation_buffer_bytes``, cached: the planner asks the same question for every
    strategy that shares a pipeline layout (building the tick table is the costly part)."""
    schedule = config.build(stages)
    per_chunk = StageLayers(cfg.num_layers, stages, schedule.virtual).per_chunk
    res_shapes, cut_shapes, x = _stage_residuals(cfg, per_chunk, exe, rows, seq_len)
    out = buffer_bytes(compile_program(schedule), res_shapes, x, cut_shapes)
    out["loop"] = _loop_residual_bytes(cfg, per_chunk, exe, rows, seq_len) \
        if per_chunk > 1 and schedule.has_backward else 0
    return out


# Chunk sizes and micro-batch rows the residual shapes are traced at (see _stage_residuals).
_PROBE_LAYERS, _PROBE_ROWS = (2, 3), (2, 3)


@functools.lru_cache(maxsize=1024)
def _stage_residuals(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                     seq_len: int):
    """One chunk's pullback residual shapes, its split backward's cut (what B_in stashes for
    W) and its activation: shared by every schedule and micro-batch count with the same chunk.

    Tracing a 40-layer chunk takes about a second and the planner asks for dozens of (layers,
    rows) pairs. Every residual dimension is a constant, the chunk's layer count (the layer
    scan stacks it), the micro-batch rows, or their product, so each dimension is bilinear in
    (layers, rows): four traces at small sizes give every pair (``_bilinear``), exact in bytes
    per leaf (one row may fold a size-1 dimension; the buffers need only bytes:
    ``tests/test_buffer_sizes.py``). A shape that does not fit that form is traced directly."""
    if per_chunk < _PROBE_LAYERS[0]:   # one layer runs unscanned: its own shapes (and cheap)
        return _trace_residuals(cfg, per_chunk, exe, rows, seq_len)
    probes = {(l, r): _trace_residuals(cfg, l, exe, r, seq_len)
              for l in _PROBE_LAYERS for r in _PROBE_ROWS}
    if (per_chunk, rows) in probes:
        return probes[(per_chunk, rows)]
    guess = _bilinear(probes, per_chunk, rows)
    return guess if guess is not None else _trace_residuals(cfg, per_chunk, exe, rows, seq_len)


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
    """The probes' shapes evaluated at (layers, rows), each dimension fitted by ``_fit``;
    None when the probes disagree in structure or a dimension does not fit."""
    flat = [jax.tree.flatten(c) for c in _corners(probes)]
    if any(f[1] != flat[0][1] for f in flat):
        return None
    leaves = []
    for sds in zip(*(f[0] for f in flat)):
        if len({len(x.shape) for x in sds}) != 1 or len({x.dtype for x in sds}) != 1:
            return None
        dims = [_fit(*ds, layers, rows) for ds in zip(*(x.shape for x in sds))]
        if min(dims, default=1) < 0:
            return None
        leaves.append(jax.ShapeDtypeStruct(tuple(dims), sds[0].dtype))
    return jax.tree.unflatten(flat[0][1], leaves)


@functools.lru_cache(maxsize=256)
def _trace_residuals(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                     seq_len: int):
    """``_stage_residuals`` by tracing the chunk's pullback (``jax.eval_shape``-style:
    nothing is allocated)."""
    am = abstract_model(cfg)
    sd = jax.ShapeDtypeStruct
    chunk = jax.tree.map(lambda a: sd((per_chunk,) + a.shape[1:], a.dtype), am.shapes["blocks"])
    pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    tokens = sd((rows, seq_len), jnp.int32)
    inputs = {"tokens": tokens, "targets": tokens, "weights": sd((rows, seq_len), jnp.float32)}
    consts = {"inv_total_weight": sd((), jnp.float32), "aux_scale": sd((), jnp.float32)}
    extras = (inputs, consts, sd((), jnp.bool_), sd((), jnp.bool_))
    stage = Stage(am.graphdef, exe, "loss")
    x = sd(stage.activation(chunk, pieces, inputs).shape, exe.dtype)
    with using_constraint(None):
        sb = StageBackward.trace(loss_only(stage), chunk, pieces, x, extras)
    return sb.shapes, sb.cut_shapes, x


@functools.lru_cache(maxsize=1024)
def _loop_residual_bytes(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                         seq_len: int) -> int:
    """``_trace_loop_bytes``, fitted bilinearly in (layers, rows) from four small traces as
    ``_stage_residuals`` is (a sum of leaves that are each bilinear)."""
    probes = {(l, r): _trace_loop_bytes(cfg, l, exe, r, seq_len)
              for l in _PROBE_LAYERS for r in _PROBE_ROWS}
    return _fit(*_corners(probes), per_chunk, rows)


@functools.lru_cache(maxsize=256)
def _trace_loop_bytes(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                      seq_len: int) -> int:
    """Bytes of the residuals one chunk's layer loop (``run_blocks``' scan) stacks for one
    micro-batch: the stash's share that the loop itself emits (the embedding's and the
    head's residuals come from the stage's conditionals, outside it), those its pullback
    reads (XLA drops the rest from the loop). Traced abstractly."""
    am = abstract_model(cfg)
    sd = jax.ShapeDtypeStruct
    chunk = jax.tree.map(lambda a: sd((per_chunk,) + a.shape[1:], a.dtype), am.shapes["blocks"])
    pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    stage = Stage(am.graphdef, exe, "loss")
    tokens = sd((rows, seq_len), jnp.int32)
    x = sd(stage.activation(chunk, pieces, {"tokens": tokens}).shape, exe.dtype)

    def blocks(chunk, pieces, x, extras):
        y, aux, _ = stage.model(chunk, pieces).run_blocks(x, exe=exe)
        return y, aux
    with using_constraint(None):
        res = Residuals.trace(blocks, chunk, pieces, x, ())
        cts = jax.eval_shape(blocks, chunk, pieces, x, ())
        read = reads(lambda stored, c, p, ct: res.pullback(stored, c, p)(ct),
                     list(res.shapes), chunk, pieces, cts)
    return sum(int(np.prod(s.shape)) * jnp.dtype(s.dtype).itemsize
               for s, r in zip(res.shapes, read) if r)
