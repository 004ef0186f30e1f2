"""The pipeline as the train step sees it: ``loss_and_grad(params, batch)`` and
``forward(params, batch)``, built from a model, a mesh, a strategy and a schedule.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> pipe = Pipeline(config.TINY, make_mesh(data=2, pipe=4), "dp",
    ...                 PipelineConfig("1f1b", microbatches=8))
    >>> (loss, aux), grads = pipe.loss_and_grad(params, batch)      # inside jit
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from triax.mesh.build import mesh_sizes
from triax.models.axes import using_constraint
from triax.models.config import ModelConfig
from triax.models.layers import ExecConfig
from triax.pipeline.executor import DATA, PIPE, StepSpec, run_ticks
from triax.pipeline.generators import build
from triax.pipeline.stage_layers import StageLayers, pipeline_strategy
from triax.pipeline.tick_program import compile_program
from triax.pipeline.schedules import Schedule, ScheduleError, ScheduleKind
from triax.pipeline.stage import make_stage_apply
from triax.sharding.partition import abstract_model, specs_for
from triax.sharding.rules import Strategy, get_strategy


def default_microbatches(stages: int) -> int:
    """Micro-batches per step when none are asked for: two per stage keeps 1F1B's bubble
    at (S-1)/(3S-1) while the stash stays at S micro-batches."""
    return 2 * stages


def unpipelinable_reason(cfg: ModelConfig) -> Optional[str]:
    """Why the executor cannot pipeline ``cfg`` (None when it can): the one home of that fact."""
    if cfg.moe is not None:
        return (f"model {cfg.name!r} is MoE: the pipeline executor runs dense models only; "
                f"train it without pipe (use expert/data axes)")
    return None


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

    def __init__(self, cfg: ModelConfig, mesh: Mesh, strategy: "str | Strategy" = "dp",
                 config: PipelineConfig = PipelineConfig(), exe: ExecConfig = ExecConfig()):
        sizes = mesh_sizes(mesh)
        self.stages = sizes.get(PIPE, 1)
        if self.stages < 2:
            raise ScheduleError(f"a pipeline needs a mesh with pipe >= 2, got {sizes}")
        reason = unpipelinable_reason(cfg)
        if reason is not None:
            raise ScheduleError(reason)
        self.cfg, self.mesh, self.exe, self.config = cfg, mesh, exe, config
        self.strategy = pipeline_strategy(get_strategy(strategy), cfg.num_layers, self.stages)
        self.schedule = config.build(self.stages)
        self.layout = StageLayers(cfg.num_layers, self.stages, self.schedule.virtual)
        self.abstract = abstract_model(cfg)
        self.data = sizes.get(DATA, 1)

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

    def _run(self, schedule: Schedule, params, batch):
        """Split params into stage layout, run the ticks, reduce; returns loss and raw grads."""
        B = batch["inputs"].shape[0]
        micro = self._check_batch(B, schedule.microbatches)
        weights = batch.get("weights")
        if weights is None:
            weights = jnp.ones(batch["inputs"].shape, jnp.float32)
        weights = weights.astype(jnp.float32)
        inv_w = 1.0 / jnp.maximum(jnp.sum(weights), 1.0)
        blocks = self.layout.to_stages(params["blocks"])
        pieces = {k: v for k, v in params.items() if k != "blocks"}
        spec = StepSpec(compile_program(schedule), make_stage_apply(self.abstract.graphdef,
                                                                    self.exe),
                        self.stages, schedule.virtual, micro, self.exe.dtype)
        bspec, pspec, bdims, pdims = self._manual_specs
        backward = schedule.has_backward

        def body(blocks, pieces, tokens, targets, weights, inv_w):
            blocks = _gather(blocks, bdims)
            pieces = _gather(pieces, pdims)
            # Activation constraints would name manual axes; parameters carry TP instead.
            with using_constraint(None):
                loss, g_blocks, g_pieces = run_ticks(spec, blocks, pieces, tokens, targets,
                                                     weights, inv_w)
            loss = jax.lax.psum(loss, (PIPE, DATA))
            if not backward:
                return loss, {}, {}
            g_pieces = jax.tree.map(lambda g: jax.lax.psum(g, PIPE), g_pieces)
            return (loss, _reduce_data(jax.tree.map(lambda g: g[None], g_blocks), bdims),
                    _reduce_data(g_pieces, pdims))

        bat = P(DATA)
        out_specs = (P(), bspec if backward else {}, pspec if backward else {})
        fn = jax.shard_map(body, mesh=self.mesh,
                           in_specs=(bspec, pspec, bat, bat, bat, P()), out_specs=out_specs,
                           axis_names={PIPE, DATA}, check_vma=False)
        return fn(blocks, pieces, batch["inputs"], batch["targets"], weights, inv_w)

    def loss_and_grad(self, params, batch):
        """``((loss, aux), grads)`` of the whole model; same contract as the train step's."""
        loss, g_blocks, g_pieces = self._run(self.schedule, params, batch)
        grads = {**g_pieces, "blocks": self.layout.from_stages(g_blocks)}
        return (loss, {"ce": loss}), grads

    def forward(self, params, batch):
        """Pipelined evaluation with the forward-only schedule: ``(loss, aux)``, no grads."""
        M = self.schedule.microbatches
        v = self.schedule.virtual
        sched = build(ScheduleKind.FORWARD_ONLY, self.stages, M, v)
        loss, _, _ = self._run(sched, params, batch)
        return loss, {"ce": loss}


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
