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

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from triax.choices import PIPELINE_FSDP_CHOICES, PIPELINE_FSDP_MODES, check
from triax.mesh.build import mesh_sizes
from triax.models import runtime
from triax.models.config import ModelConfig
from triax.models.runtime import ExecConfig
from triax.models.moe import run_locally
from triax.models.protocol import loss_metric, loss_weight, missing_protocol
from triax.pipeline.executor import DATA, PIPE, RunResult, StepSpec, branch_kinds, run_ticks
from triax.pipeline.fsdp import FSDP, auto_spec, data_dim, manual_spec
from triax.pipeline.generators import build
from triax.pipeline.schedules import Schedule, ScheduleError, ScheduleKind
from triax.pipeline.stage import Stage
from triax.pipeline.stage_layers import StageLayers, pipeline_strategy
from triax.pipeline.tick_program import compile_program
from triax.sharding.experts import expert_parallel_size
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


def unpipelinable_mesh_reason(cfg: Optional[ModelConfig], sizes: dict[str, int],
                              rules) -> Optional[str]:
    """Why the executor cannot pipeline ``cfg`` on a mesh of ``sizes`` under ``rules`` (None
    when it can), as the planner asks it of a workload (a config, or None for a bare
    parameter count); ``Pipeline`` asks :func:`experts_mesh_reason` of any model with an
    expert stack, so both refuse the same meshes.

    An MoE stack with its experts split over ``expert`` and the expert FFN over ``tensor``
    makes XLA's SPMD partitioner abort the compile (``spmd_partitioner_util.cc`` "Check
    failed: partition_group_list...", jax 0.10.2) on most such meshes, e.g. tiny-moe on
    pipe=2 × expert=2 × tensor=2 with ``tp``: refused, with the way round, rather than
    killing the process (``tests/test_planner_decide.py`` keeps a reproducer).
    """
    if cfg is None or cfg.moe is None:   # the planner's workloads: a config or a size
        return None
    return experts_mesh_reason(sizes, rules)


def experts_mesh_reason(sizes: dict[str, int], rules) -> Optional[str]:
    """:func:`unpipelinable_mesh_reason` for a model with an expert stack: the one home of
    the fact."""
    if sizes.get(PIPE, 1) < 2:
        return None
    if rules.split_size("experts", sizes) > 1 and rules.split_size("expert_mlp", sizes) > 1:
        return ("a pipelined MoE stack with experts split over 'expert' and the expert FFN "
                "over 'tensor' aborts XLA's SPMD partitioner; split the experts over "
                "'expert' without tensor parallelism (e.g. strategy dp), or drop pipe")
    return None


@dataclass(frozen=True)
class PipelineConfig:
    """Which schedule to run. ``microbatches=0`` means two per stage (``default_microbatches``).
    ``fsdp``: how a stage holds weights FSDP splits over `data` (``choices.
    PIPELINE_FSDP_MODES``): ``stage`` gathers them once per step, ``layer`` per layer per op
    (``pipeline.fsdp``); ``auto`` is resolved before a pipeline is built
    (``training.setup.pipeline_fsdp_for``). ``stage_layers``: uneven stages, the layers each
    stage runs (``pipeline.stage_counts``; None: as even as the count allows)."""

    schedule: str = "1f1b"
    microbatches: int = 0
    virtual: int = 1
    fsdp: str = "stage"
    stage_layers: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        check("pipeline_fsdp", self.fsdp, PIPELINE_FSDP_CHOICES)

    def num_microbatches(self, stages: int) -> int:
        """Micro-batches per step for ``stages`` pipeline stages."""
        return self.microbatches or default_microbatches(stages)

    def build(self, stages: int, kind: Optional[str] = None) -> Schedule:
        """The schedule's tick table for ``stages`` stages (``kind`` overrides ``schedule``)."""
        return build(kind or self.schedule, stages, self.num_microbatches(stages), self.virtual)


class Pipeline:
    """A compiled-schedule pipeline for one model on one mesh (``pipe >= 2``)."""

    def __init__(self, model: "ModelConfig | AbstractModel", mesh: Mesh,
                 strategy: "str | Strategy" = "dp", config: PipelineConfig = PipelineConfig(),
                 exe: ExecConfig = ExecConfig()):
        """``model``: the built-in decoder's config, or any model's :class:`AbstractModel`
        (``triax.sharding.abstract_module``): either follows ``models.protocol.PipelineModel``."""
        sizes = mesh_sizes(mesh)
        self.stages = sizes.get(PIPE, 1)
        if self.stages < 2:
            raise ScheduleError(f"a pipeline needs a mesh with pipe >= 2, got {sizes}")
        am = model if isinstance(model, AbstractModel) else abstract_model(model)
        reason = _protocol_problem(am)
        if reason is not None:
            raise ScheduleError(reason)
        if config.fsdp not in PIPELINE_FSDP_MODES:
            raise ScheduleError(f"PipelineConfig(fsdp={config.fsdp!r}): resolve it to one of "
                                f"{PIPELINE_FSDP_MODES} first (training.setup."
                                f"pipeline_fsdp_for)")
        self.by_layer = config.fsdp == "layer"
        self.mesh, self.exe, self.config = mesh, exe, config
        num_layers = jax.tree.leaves(am.shapes["blocks"])[0].shape[0]
        self.strategy = pipeline_strategy(get_strategy(strategy), num_layers, self.stages,
                                          config.stage_layers)
        # The model's own [L, ...] form (checkpoints, equality checks): whole over pipe
        # where L does not split evenly.
        self.model_strategy = pipeline_strategy(get_strategy(strategy), num_layers,
                                                self.stages)
        # A stack of experts (a parameter named "experts", e.g. models.moe.MoE) routes its
        # tokens with an all-to-all over the expert axis, whoever wrote the model.
        self.experts = any("experts" in names for names in
                           jax.tree.leaves(am.logical, is_leaf=lambda x: isinstance(x, tuple)))
        reason = experts_mesh_reason(sizes, self.strategy.rules) if self.experts else None
        if reason is not None:
            raise ScheduleError(f"mesh {sizes}, strategy {self.strategy.name}: {reason}")
        self.schedule = config.build(self.stages)
        self.layout = StageLayers.of(num_layers, self.schedule, config.stage_layers)
        self.abstract = am
        self.data = sizes.get(DATA, 1)

    @property
    def branch_kinds(self) -> tuple[str, ...]:
        """The training step's tick-switch branches in order (``executor.branch_kinds``)."""
        return branch_kinds(self.schedule)

    @cached_property
    def stored(self) -> AbstractModel:
        """The model as the pipeline stores it: the blocks' stack in stage order,
        ``[S·Lc, ...]``, when the stages restack it (``StageLayers.restacked``: stages of
        their own lengths), else the model itself. The train state has these shapes."""
        if not self.layout.restacked:
            return self.abstract
        n = self.layout.stored_layers
        shapes = {**self.abstract.shapes, "blocks": jax.tree.map(
            lambda s: jax.ShapeDtypeStruct((n,) + s.shape[1:], s.dtype),
            self.abstract.shapes["blocks"])}
        return replace(self.abstract, shapes=shapes)

    def store(self, params):
        """The model's parameters (or any tree of them: gradients, a trainable part) →
        :attr:`stored` form (``StageLayers.store``)."""
        return self._blocks(params, self.layout.store)

    def unstore(self, params):
        """Inverse of :meth:`store`: the model's ``[L, ...]`` form."""
        return self._blocks(params, self.layout.unstore)

    def _blocks(self, params, fn):
        if not self.layout.restacked or "blocks" not in params:
            return params
        return {**params, "blocks": fn(params["blocks"])}

    @cached_property
    def param_specs(self):
        return specs_for(self.strategy.rules, self.stored.logical, self.stored.shapes,
                         self.mesh)

    @cached_property
    def _manual_specs(self):
        """shard_map specs over the manual axes, each leaf's `data`-sharded dim (FSDP), and
        each leaf's spec over the other (automatic) axes, which the FSDP gather keeps; last,
        one layer's (FSDP by layer), its leaves flat in the blocks' order."""
        is_p = lambda x: isinstance(x, P)  # noqa: E731
        blocks = self.param_specs["blocks"]
        pieces = {k: v for k, v in self.param_specs.items() if k != "blocks"}
        # Blocks enter as [S, v, Lc, ...]: pipe on the stage dim, then the layer spec's rest.
        bspec = jax.tree.map(lambda s: manual_spec(s[1:], (PIPE, None, None)), blocks,
                             is_leaf=is_p)
        bdims = jax.tree.map(lambda s: None if data_dim(s[1:]) is None else
                             data_dim(s[1:]) + 3, blocks, is_leaf=is_p)
        bauto = jax.tree.map(lambda s: P(None, None, None, *auto_spec(s[1:])), blocks,
                             is_leaf=is_p)
        layer = jax.tree.leaves(blocks, is_leaf=is_p)
        return (bspec, jax.tree.map(manual_spec, pieces, is_leaf=is_p),
                FSDP(bdims, bauto),
                FSDP(jax.tree.map(data_dim, pieces, is_leaf=is_p),
                     jax.tree.map(auto_spec, pieces, is_leaf=is_p)),
                FSDP([data_dim(s[1:]) for s in layer], [auto_spec(s[1:]) for s in layer]))

    def _check_batch(self, B: int, M: int) -> int:
        if B % (self.data * M):
            raise ScheduleError(
                f"batch {B} must split into {self.data} data shard(s) x {M} micro-batches; "
                f"choose a batch size that is a multiple of {self.data * M}")
        micro = B // (self.data * M)
        ep = expert_parallel_size(self.mesh, self.strategy.rules) if self.experts else 1
        if micro % ep:
            raise ScheduleError(
                f"a micro-batch of {micro} rows per data shard must split over the expert "
                f"axis ({ep}) for the all-to-all; choose a batch size that is a multiple of "
                f"{self.data * M * ep} or fewer micro-batches")
        return micro

    @cached_property
    def _model(self):
        """The model, abstract (its attributes, e.g. the protocol's ``loss_metric``)."""
        return nnx.merge(self.abstract.graphdef, self.abstract.shapes)

    @cached_property
    def _stages(self) -> dict:
        return {head: Stage(self.abstract.graphdef, self.exe, head) for head in ("loss", "logits")}

    def _forward_schedule(self) -> Schedule:
        """Evaluation and decode: the forward-only schedule over the training schedule's
        chunks (one chunk per stage under ZB-V: a forward alone gains nothing from the V,
        and the layers then stay where they are stored)."""
        v = 1 if self.schedule.kind.v_shape else self.schedule.virtual
        return build(ScheduleKind.FORWARD_ONLY, self.stages, self.schedule.microbatches, v)

    def _run(self, schedule: Schedule, stage: Stage, params, inputs: dict, consts: dict,
             state=None) -> RunResult:
        """Split params into stage layout and run the ticks in one ``shard_map`` (manual over
        pipe and data), then reduce once.

        ``inputs``: ``{name: [B, ...]}``, rows split over data shards, then into micro-batches;
        ``consts``: replicated values every op sees; ``state``: None, or per-layer, per-row
        arrays ``[L, R, ...]`` (a KV cache: R rows, or a pool's row groups, as many per
        micro-batch), split over stages like the blocks and over rows like the batch. Returns a :class:`~triax.pipeline.executor.RunResult`: outputs are
        ``[S, B, ...]`` per stage (the last stage's are the model's), grads ``{}`` for a
        forward-only schedule.
        """
        B = jax.tree.leaves(inputs)[0].shape[0]
        M = schedule.microbatches
        micro = self._check_batch(B, M)
        lay = StageLayers.of(self.layout.num_layers, schedule, self.layout.counts)
        blocks = lay.enter(params["blocks"])       # [S, v, Lc, ...]
        pieces = {k: v for k, v in params.items() if k != "blocks"}
        # Per-layer state comes in the model's [L, ...] form: stored as the blocks are.
        state = {} if state is None else lay.enter(lay.store(state))  # [S, v, Lc, B, ...]
        spec = StepSpec(compile_program(schedule), stage, self.stages, self.exe.dtype,
                        lay.layer_ids(), state_mb_axis=1, slot_counts=lay.slot_counts)
        bspec, pspec, bfsdp, pfsdp, lfsdp = self._manual_specs
        by_layer = self.by_layer and bfsdp.splits
        backward = schedule.has_backward
        rows = lambda a, n: a.reshape(a.shape[:n] + (-1,) + a.shape[n + 2:])  # noqa: E731

        def routes(tree, move, **into):  # [1, v, ...] leaves between storage and compute order
            if not lay.routed:
                return tree
            into = {k: jax.tree.map(lambda a: a[0], t) for k, t in into.items()}
            moved = move(jax.tree.map(lambda a: a[0], tree), PIPE, **into)
            return jax.tree.map(lambda a: a[None], moved)

        def body(blocks, pieces, inputs, consts, state):
            routed = routes(blocks, lay.to_compute)  # before the FSDP gather: 1/data of a chunk
            # [v, Lc, ...]: gathered once here, or (by layer) as the stack scan runs a layer.
            blocks = jax.tree.map(lambda a: a[0], routed if by_layer else bfsdp.gather(routed))
            state = routes(state, lay.to_compute)
            pieces = pfsdp.gather(pieces)
            inputs = jax.tree.map(lambda a: a.reshape((M, micro) + a.shape[1:]), inputs)
            # [1, v, Lc, R/data, ...] -> [v, Lc, M, R/(data·M), ...]: micro-batch axis 1 after
            # v. R: the batch rows, or a paged KV pool's row groups (one per micro-batch).
            state = jax.tree.map(lambda a: a[0].reshape(a.shape[1:3] + (M, -1) + a.shape[4:]),
                                 state)
            # Activation constraints would name manual axes; parameters carry TP instead.
            with runtime.using(constraint=None,
                               moe_runner=_stats_over_data(runtime.current().moe_runner),
                               layer_params=lfsdp.gather_layer if by_layer else None):
                res = run_ticks(spec, blocks, pieces, inputs, consts, state)
            loss = jax.lax.psum(res.loss, (PIPE, DATA))
            outputs = jax.tree.map(lambda a: rows(a, 0)[None], res.outputs)
            state = routes(jax.tree.map(lambda a: rows(a, 2)[None], res.state), lay.to_storage)
            if not backward:
                return loss, outputs, state, {}, {}
            g_pieces = jax.tree.map(lambda g: jax.lax.psum(g, PIPE), res.grads["pieces"])
            g_blocks = jax.tree.map(lambda g: g[None], res.grads["blocks"])
            g_blocks = bfsdp.reduce_unsplit(g_blocks) if by_layer else bfsdp.reduce(g_blocks)
            # The routed weights are dead after the ticks: their buffers take the gradients
            # back to storage order (unless a once-per-step FSDP gather made the ticks' copy,
            # and the routed 1/data was free long before).
            into = {"into": routed} if by_layer or not bfsdp.splits else {}
            return (loss, outputs, state, routes(g_blocks, lay.to_storage, **into),
                    pfsdp.reduce(g_pieces))

        bat, per_stage_rows, state_spec = P(DATA), P(PIPE, DATA), P(PIPE, None, None, DATA)
        out_specs = (P(), per_stage_rows, state_spec, bspec if backward else {},
                     pspec if backward else {})
        fn = jax.shard_map(body, mesh=self.mesh,
                           in_specs=(bspec, pspec, bat, P(), state_spec), out_specs=out_specs,
                           axis_names={PIPE, DATA}, check_vma=False)
        loss, outputs, state, g_blocks, g_pieces = fn(blocks, pieces, inputs, consts, state)
        if state:
            state = lay.unstore(lay.leave(state))
        return RunResult(loss, outputs, state, g_blocks, g_pieces)

    def _loss_run(self, schedule: Schedule, params, batch):
        model = nnx.merge(self.abstract.graphdef, params)
        consts = {"inv_total_weight": 1.0 / loss_weight(model, batch),
                  "aux_scale": jnp.float32(1.0 / (schedule.microbatches * self.data))}
        # Every leaf of the batch travels with its rows (packed documents' boundaries, the
        # zigzag layout's causal order: training.step.Trainer.balanced).
        r = self._run(schedule, self._stages["loss"], params, self._data_major(dict(batch)),
                      consts)
        return r.loss, r.grad_blocks, r.grad_pieces

    def _data_major(self, tree):
        """Reorder the batch rows so that `data` is their major split. The batch is stored
        split over the rules' batch axes in order (``("expert", "data")``: expert-major);
        the pipeline's manual `data` wants each shard's rows contiguous. On the stored
        layout this is a relabelling (every row stays on its device), where splitting the
        stored order over `data` would move rows between devices."""
        sizes = mesh_sizes(self.mesh)
        axes = [a for a in self.strategy.rules.mesh_axes("batch") if sizes.get(a, 1) > 1]
        if DATA not in axes or axes[0] == DATA:
            return tree
        k, lead = len(axes), [sizes[a] for a in axes]
        perm = [axes.index(DATA)] + [i for i, a in enumerate(axes) if a != DATA]

        def one(a):
            split = a.reshape(lead + [-1] + list(a.shape[1:]))
            return split.transpose(perm + list(range(k, split.ndim))).reshape(a.shape)
        return jax.tree.map(one, tree)

    def _with_aux(self, loss):
        """``(loss, aux)`` from the stages' summed loss (a dict with a MoE's aux losses)."""
        if isinstance(loss, dict):
            return loss["loss"], {k: v for k, v in loss.items() if k != "loss"}
        metric = loss_metric(self._model)
        return loss, {metric: loss} if metric else {}

    def loss_and_grad(self, params, batch):
        """``((loss, aux), grads)`` of the whole model; same contract as the train step's.
        A MoE's auxiliary losses are per micro-batch, averaged (``stage._with_aux``)."""
        loss, g_blocks, g_pieces = self._loss_run(self.schedule, params, batch)
        grads = {**g_pieces, "blocks": self.layout.leave(g_blocks)}
        return self._with_aux(loss), grads

    def forward(self, params, batch):
        """Pipelined evaluation with the forward-only schedule: ``(loss, aux)``, no grads."""
        loss, _, _ = self._loss_run(self._forward_schedule(), params, batch)
        return self._with_aux(loss)

    def decode(self, params, tokens_BT, positions_BT, cache):
        """``(logits_BTV, cache)`` for ``T`` new tokens per row at ``positions_BT``, through
        the forward-only schedule; each stage reads and writes its own layers' KV cache
        (``triax.models.decode``), micro-batch by micro-batch."""
        inputs = {"inputs": tokens_BT, "positions": positions_BT}
        r = self._run(self._forward_schedule(), self._stages["logits"], params, inputs, {},
                      cache)
        return r.outputs[-1], r.state


def _stats_over_data(inner):
    """A MoE runner for inside the pipeline: ``inner``'s (None: whole arrays), with the router
    statistics summed over the manual `data` axis too, so a micro-batch's auxiliary losses
    cover its rows on every data shard (as the unpipelined model's cover the whole batch)."""
    def run(token_fn, x_BTD, router_DE, weights):
        y_BTD, stats = (inner or run_locally)(token_fn, x_BTD, router_DE, weights)
        return y_BTD, jax.lax.psum(stats, DATA)
    return run


def _protocol_problem(am: AbstractModel) -> Optional[str]:
    """Why a model cannot be pipelined (None when it follows the protocol)."""
    with nnx.use_eager_sharding(False):
        missing = missing_protocol(nnx.merge(am.graphdef, am.shapes))
    if missing or "blocks" not in am.shapes:
        return (f"{_model_name(am)} cannot be pipelined: it lacks {missing or ['blocks']} "
                f"of the protocol triax.models.protocol.PipelineModel (a stack of identical "
                f"blocks named 'blocks', embed(batch), block(block, x, batch), "
                f"head_loss(x, batch)); see docs/your_model.md")
    return None


def _model_name(am: AbstractModel) -> str:
    return type(nnx.merge(am.graphdef, am.shapes)).__name__
