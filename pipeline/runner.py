"""The pipeline as its callers see it: ``loss_and_grad(params, batch)`` and
``forward(params, batch)`` for the train step and evaluation, ``decode(params, tokens,
positions, cache)`` for generation — one tick loop (``executor.run_ticks``) under all three,
built from a model, a mesh, a strategy and a schedule.

    >>> import jax, jax.numpy as jnp
    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> from triax.sharding.partition import init_params
    >>> mesh = make_mesh(pipe=2, devices=jax.devices()[:2])
    >>> cfg = config.TINY.replace(num_layers=2)
    >>> pipe = Pipeline(cfg, mesh, "dp", PipelineConfig("1f1b", microbatches=4))
    >>> params = init_params(pipe.abstract, mesh, "dp", seed=0)
    >>> batch = {"inputs": jnp.zeros((8, 16), jnp.int32), "targets": jnp.zeros((8, 16), jnp.int32)}
    >>> (loss, aux), grads = jax.jit(pipe.loss_and_grad)(params, batch)
    >>> sorted(grads) == sorted(params)
    True
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from triax.mesh.build import mesh_sizes
from triax.models.axes import using_constraint
from triax.models.config import ModelConfig
from triax.models.layers import ExecConfig
from triax.pipeline.executor import (DATA, PIPE, StepSpec, branch_kinds, buffer_bytes,
                                     loss_only, run_ticks)
from triax.pipeline.chunk_routes import to_compute, to_storage
from triax.pipeline.generators import build
from triax.pipeline.schedules import Schedule, ScheduleError, ScheduleKind
from triax.pipeline.stage import (ProtocolStage, Residuals, Stage, loss_weight,
                                  missing_protocol)
from triax.pipeline.stage_layers import StageLayers, pipeline_strategy
from triax.pipeline.tick_program import compile_program
from triax.sharding.partition import AbstractModel, abstract_model, specs_for
from triax.sharding.rules import Strategy, get_strategy


def default_microbatches(stages: int) -> int:
    """Micro-batches per step when none are asked for: two per stage keeps 1F1B's bubble
    at (S-1)/(3S-1) while the stash stays at S micro-batches."""
    return 2 * stages


def default_decode_microbatches(stages: int) -> int:
    """Decode micro-batches when none are asked for: one per stage, so every stage works in
    the middle tick while each micro-batch keeps as many rows as possible (decode rows are few
    and a tick's matmuls are already small)."""
    return stages


def unpipelinable_reason(cfg: ModelConfig) -> Optional[str]:
    """Why the executor cannot pipeline ``cfg`` (None when it can): the one home of that fact."""
    if cfg.moe is not None:
        return (f"model {cfg.name!r} is MoE: the pipeline executor runs dense models only; "
                f"run it without pipe (use expert/data axes)")
    return None


def activation_buffer_bytes(cfg: ModelConfig, stages: int, config: "PipelineConfig",
                            exe: ExecConfig, rows: int, seq_len: int) -> dict[str, int]:
    """Per-stage bytes of the training tick loop's activation buffers (``executor.
    buffer_bytes``): the stash of pullback residuals and the inboxes, for micro-batches of
    ``rows`` sequences of ``seq_len`` tokens on one data shard. Traced abstractly
    (``jax.eval_shape``; nothing is allocated), so it prices a 70B model on a laptop.

    Shapes are the stage's view inside ``shard_map``: whole over ``tensor`` (that axis stays
    automatic; XLA may split some residuals over it, so this is an upper bound there).
    """
    schedule = config.build(stages)
    per_chunk = StageLayers(cfg.num_layers, stages, schedule.virtual).per_chunk
    res_shapes, x = _stage_residuals(cfg, per_chunk, exe, rows, seq_len)
    return buffer_bytes(compile_program(schedule), res_shapes, x)


@functools.lru_cache(maxsize=64)
def _stage_residuals(cfg: ModelConfig, per_chunk: int, exe: ExecConfig, rows: int,
                     seq_len: int):
    """One chunk's pullback residual shapes and its activation: the costly trace, shared by
    every schedule and micro-batch count with the same chunk (the planner asks many)."""
    am = abstract_model(cfg)
    sd = jax.ShapeDtypeStruct
    chunk = jax.tree.map(lambda a: sd((per_chunk,) + a.shape[1:], a.dtype), am.shapes["blocks"])
    pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    tokens = sd((rows, seq_len), jnp.int32)
    inputs = {"tokens": tokens, "targets": tokens, "weights": sd((rows, seq_len), jnp.float32)}
    extras = (inputs, {"inv_total_weight": sd((), jnp.float32)}, sd((), jnp.bool_),
              sd((), jnp.bool_))
    stage = Stage(am.graphdef, exe, "loss")
    x = sd(stage.activation(chunk, pieces, inputs).shape, exe.dtype)
    with using_constraint(None):
        res = Residuals.trace(loss_only(stage), chunk, pieces, x, extras)
    return res.shapes, x


@dataclass(frozen=True)
class PipelineConfig:
    """Which schedule to run. ``microbatches=0`` means :func:`default_microbatches`."""

    schedule: str = "1f1b"
    microbatches: int = 0
    virtual: int = 1

    def num_microbatches(self, stages: int) -> int:
        return self.microbatches or default_microbatches(stages)

    def build(self, stages: int, kind: Optional[str] = None) -> Schedule:
        return build(kind or self.schedule, stages, self.num_microbatches(stages), self.virtual)


def _manual_spec(spec: P, lead: tuple = ()) -> P:
    """Keep only the manual axes (`data`) of a parameter spec, after ``lead`` entries."""
    keep = []
    for e in spec:
        axes = (e,) if isinstance(e, str) else tuple(e or ())
        keep.append(DATA if DATA in axes else None)
    return P(*lead, *keep)


def _data_dim(spec: P) -> Optional[int]:
    for i, e in enumerate(spec):
        if DATA in ((e,) if isinstance(e, str) else tuple(e or ())):
            return i
    return None


class Pipeline:
    """A compiled-schedule pipeline for one model on one mesh (``pipe >= 2``)."""

    def __init__(self, model: "ModelConfig | AbstractModel", mesh: Mesh,
                 strategy: "str | Strategy" = "dp", config: PipelineConfig = PipelineConfig(),
                 exe: ExecConfig = ExecConfig()):
        """``model``: the built-in decoder's config, or any model's :class:`AbstractModel`
        (``triax.sharding.abstract_module``) that follows ``stage.PipelineModel``."""
        sizes = mesh_sizes(mesh)
        self.stages = sizes.get(PIPE, 1)
        if self.stages < 2:
            raise ScheduleError(f"a pipeline needs a mesh with pipe >= 2, got {sizes}")
        am = model if isinstance(model, AbstractModel) else abstract_model(model)
        reason = (unpipelinable_reason(am.cfg) if am.cfg is not None
                  else _protocol_problem(am))
        if reason is not None:
            raise ScheduleError(reason)
        self.cfg, self.mesh, self.exe, self.config = am.cfg, mesh, exe, config
        num_layers = jax.tree.leaves(am.shapes["blocks"])[0].shape[0]
        self.strategy = pipeline_strategy(get_strategy(strategy), num_layers, self.stages)
        self.schedule = config.build(self.stages)
        self.layout = StageLayers(num_layers, self.stages, self.schedule.virtual)
        self.abstract = am
        self.data = sizes.get(DATA, 1)

    @property
    def branch_kinds(self) -> tuple[str, ...]:
        """The training step's tick-switch branches in order (``executor.branch_kinds``)."""
        return branch_kinds(self.schedule)

    def activation_buffer_bytes(self, batch_size: int, seq_len: int) -> dict[str, int]:
        """:func:`activation_buffer_bytes` of this pipeline's training step."""
        if self.cfg is None:
            raise ValueError("activation_buffer_bytes prices the built-in decoder; for a "
                             "user's model read the compiled step's memory_analysis")
        rows = self._check_batch(batch_size, self.schedule.microbatches)
        return activation_buffer_bytes(self.cfg, self.stages, self.config, self.exe, rows,
                                       seq_len)

    @cached_property
    def param_specs(self):
        return specs_for(self.strategy.rules, self.abstract.logical, self.abstract.shapes,
                         self.mesh)

    @cached_property
    def _manual_specs(self):
        """shard_map specs over the manual axes, and each leaf's `data`-sharded dim (FSDP)."""
        is_p = lambda x: isinstance(x, P)  # noqa: E731
        blocks = self.param_specs["blocks"]
        pieces = {k: v for k, v in self.param_specs.items() if k != "blocks"}
        # Blocks enter as [S, v, Lc, ...]: pipe on the stage dim, then the layer spec's rest.
        bspec = jax.tree.map(lambda s: _manual_spec(s[1:], (PIPE, None, None)), blocks,
                             is_leaf=is_p)
        bdims = jax.tree.map(lambda s: None if _data_dim(s[1:]) is None else
                             _data_dim(s[1:]) + 3, blocks, is_leaf=is_p)
        return (bspec, jax.tree.map(_manual_spec, pieces, is_leaf=is_p), bdims,
                jax.tree.map(_data_dim, pieces, is_leaf=is_p))

    def _check_batch(self, B: int, M: int) -> int:
        if B % (self.data * M):
            raise ScheduleError(
                f"batch {B} must split into {self.data} data shard(s) x {M} micro-batches; "
                f"choose a batch size that is a multiple of {self.data * M}")
        return B // (self.data * M)

    @cached_property
    def _stages(self) -> dict:
        if self.cfg is None:   # a user's model: its own embed / block / head_loss
            return {"loss": ProtocolStage(self.abstract.graphdef)}
        return {head: Stage(self.abstract.graphdef, self.exe, head) for head in ("loss", "logits")}

    def _forward_schedule(self) -> Schedule:
        return build(ScheduleKind.FORWARD_ONLY, self.stages, self.schedule.microbatches,
                     self.schedule.virtual)

    def _run(self, schedule: Schedule, stage: Stage, params, inputs: dict, consts: dict,
             state=None):
        """Split params into stage layout and run the ticks in one ``shard_map`` (manual over
        pipe and data), then reduce once.

        ``inputs``: ``{name: [B, ...]}``, rows split over data shards, then into micro-batches;
        ``consts``: replicated values every op sees; ``state``: None, or per-layer, per-row
        arrays ``[L, B, ...]`` (a KV cache), split over stages like the blocks and over rows
        like the batch. Returns ``(loss, outputs, state, g_blocks, g_pieces)``: outputs are
        ``[S, B, ...]`` per stage (the last stage's are the model's), grads ``{}`` for a
        forward-only schedule.
        """
        B = jax.tree.leaves(inputs)[0].shape[0]
        M = schedule.microbatches
        micro = self._check_batch(B, M)
        lay = self.layout
        blocks = lay.enter(params["blocks"])       # [S, v, Lc, ...]
        pieces = {k: v for k, v in params.items() if k != "blocks"}
        state = {} if state is None else lay.enter(state)  # [S, v, Lc, B, ...]
        spec = StepSpec(compile_program(schedule), stage, self.stages, schedule.virtual,
                        self.exe.dtype, state_mb_axis=1)
        bspec, pspec, bdims, pdims = self._manual_specs
        backward = schedule.has_backward
        rows = lambda a, n: a.reshape(a.shape[:n] + (M * micro,) + a.shape[n + 2:])  # noqa: E731

        def routes(tree, move):  # [1, v, ...] leaves between storage and compute order
            if not lay.routed:
                return tree
            moved = move(jax.tree.map(lambda a: a[0], tree), lay.stages, lay.virtual, PIPE)
            return jax.tree.map(lambda a: a[None], moved)

        def body(blocks, pieces, inputs, consts, state):
            blocks = routes(blocks, to_compute)   # before the FSDP gather: 1/data of a chunk
            blocks = jax.tree.map(lambda a: a[0], _gather(blocks, bdims))   # [v, Lc, ...]
            state = routes(state, to_compute)
            pieces = _gather(pieces, pdims)
            inputs = jax.tree.map(lambda a: a.reshape((M, micro) + a.shape[1:]), inputs)
            # [1, v, Lc, B/data, ...] -> [v, Lc, M, micro, ...]: micro-batch axis 1 after v.
            state = jax.tree.map(lambda a: a[0].reshape(a.shape[1:3] + (M, micro) + a.shape[4:]),
                                 state)
            # Activation constraints would name manual axes; parameters carry TP instead.
            with using_constraint(None):
                res = run_ticks(spec, blocks, pieces, inputs, consts, state)
            loss = jax.lax.psum(res.loss, (PIPE, DATA))
            outputs = jax.tree.map(lambda a: rows(a, 0)[None], res.outputs)
            state = routes(jax.tree.map(lambda a: rows(a, 2)[None], res.state), to_storage)
            if not backward:
                return loss, outputs, state, {}, {}
            g_pieces = jax.tree.map(lambda g: jax.lax.psum(g, PIPE), res.grads["pieces"])
            g_blocks = _reduce_data(jax.tree.map(lambda g: g[None], res.grads["blocks"]), bdims)
            return (loss, outputs, state, routes(g_blocks, to_storage),
                    _reduce_data(g_pieces, pdims))

        bat, per_stage_rows, state_spec = P(DATA), P(PIPE, DATA), P(PIPE, None, None, DATA)
        out_specs = (P(), per_stage_rows, state_spec, bspec if backward else {},
                     pspec if backward else {})
        fn = jax.shard_map(body, mesh=self.mesh,
                           in_specs=(bspec, pspec, bat, P(), state_spec), out_specs=out_specs,
                           axis_names={PIPE, DATA}, check_vma=False)
        loss, outputs, state, g_blocks, g_pieces = fn(blocks, pieces, inputs, consts, state)
        if state:
            state = lay.leave(state)
        return loss, outputs, state, g_blocks, g_pieces

    def _loss_run(self, schedule: Schedule, params, batch):
        if self.cfg is None:
            model = nnx.merge(self.abstract.graphdef, params)
            consts = {"inv_total_weight": 1.0 / loss_weight(model, batch)}
            loss, _, _, g_blocks, g_pieces = self._run(schedule, self._stages["loss"], params,
                                                       dict(batch), consts)
            return loss, g_blocks, g_pieces
        weights = batch.get("weights")
        if weights is None:
            weights = jnp.ones(batch["inputs"].shape, jnp.float32)
        weights = weights.astype(jnp.float32)
        inputs = {"tokens": batch["inputs"], "targets": batch["targets"], "weights": weights}
        consts = {"inv_total_weight": 1.0 / jnp.maximum(jnp.sum(weights), 1.0)}
        loss, _, _, g_blocks, g_pieces = self._run(schedule, self._stages["loss"], params,
                                                   inputs, consts)
        return loss, g_blocks, g_pieces

    def loss_and_grad(self, params, batch):
        """``((loss, aux), grads)`` of the whole model; same contract as the train step's."""
        loss, g_blocks, g_pieces = self._loss_run(self.schedule, params, batch)
        grads = {**g_pieces, "blocks": self.layout.leave(g_blocks)}
        return (loss, {} if self.cfg is None else {"ce": loss}), grads

    def forward(self, params, batch):
        """Pipelined evaluation with the forward-only schedule: ``(loss, aux)``, no grads."""
        loss, _, _ = self._loss_run(self._forward_schedule(), params, batch)
        return loss, {} if self.cfg is None else {"ce": loss}

    def decode(self, params, tokens_BT, positions_BT, cache):
        """``(logits_BTV, cache)`` for ``T`` new tokens per row at ``positions_BT``, through
        the forward-only schedule; each stage reads and writes its own layers' KV cache
        (``triax.models.decode``), micro-batch by micro-batch."""
        inputs = {"tokens": tokens_BT, "positions": positions_BT}
        _, logits, cache, _, _ = self._run(self._forward_schedule(), self._stages["logits"],
                                           params, inputs, {}, cache)
        return logits[-1], cache


def _protocol_problem(am: AbstractModel) -> Optional[str]:
    """Why a user's model cannot be pipelined (None when it follows the protocol)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: am.make(nnx.Rngs(0)))
    missing = missing_protocol(model)
    if missing or "blocks" not in am.shapes:
        return (f"{type(model).__name__} cannot be pipelined: it lacks {missing or ['blocks']} "
                f"of the protocol triax.pipeline.stage.PipelineModel (a stack of identical "
                f"blocks named 'blocks', embed(batch), block(block, x, batch), "
                f"head_loss(x, batch)); see docs/your_model.md")
    return None


def _gather(tree, dims):
    """FSDP: all-gather the `data`-sharded dimension once per step (outside the tick loop)."""
    return jax.tree.map(lambda a, d: a if d is None else
                        jax.lax.all_gather(a, DATA, axis=d, tiled=True), tree, dims)


def _reduce_data(tree, dims):
    """The one data-parallel gradient reduction of the step (reduce-scatter under FSDP)."""
    return jax.tree.map(lambda g, d: jax.lax.psum(g, DATA) if d is None else
                        jax.lax.psum_scatter(g, DATA, scatter_dimension=d, tiled=True),
                        tree, dims)


def pipeline_forward(cfg: ModelConfig, mesh: Mesh, strategy="dp",
                     config: PipelineConfig = PipelineConfig(), exe: ExecConfig = ExecConfig()):
    """``fn(params, batch) -> (loss, aux)``: pipelined evaluation, for eval and inference."""
    return Pipeline(cfg, mesh, strategy, config, exe).forward
