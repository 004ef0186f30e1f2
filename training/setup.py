"""One path from a ``RunConfig`` to a runnable run: mesh, pipeline choice, batch check, trainer.

``triax train``, ``triax inspect``, ``triax.planner.verify`` and the run-level benches
(``bench/train.py``, ``bench/pipeline.py``, ``bench/strategies.py``) start here, so
whether and how to pipeline is decided once (``pipeline_for``): a mesh with ``pipe > 1``
runs ``triax.pipeline``'s schedule (every built-in model pipelines, MoE included). The
schedule is built here, so a bad
schedule / micro-batch combination fails before anything compiles.

    >>> from triax.training.config import RunConfig
    >>> run = build_run(RunConfig.of(model="tiny", num_layers=2, mesh="data=2,tensor=2,pipe=2",
    ...                              batch_size=8, seq_len=16))
    >>> run.pipeline, run.trainer.pipeline.schedule.microbatches
    (PipelineConfig(schedule='1f1b', microbatches=0, virtual=1, fsdp='stage', stage_layers=None), 4)
    >>> build_run(RunConfig.of(mesh="data=8", batch_size=12))
    Traceback (most recent call last):
    ...
    ValueError: --batch-size 12 is not divisible by data (8) × micro-batches (1) = 8; use e.g. --batch-size 16
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import jax
from jax.sharding import Mesh

from triax.costs.fits import device_capacity
from triax.costs.memory import estimate
from triax.costs.offload import cheaper_update
from triax.costs.workload import Layout, Workload
from triax.mesh import describe, make_hybrid_mesh, make_mesh, mesh_sizes, parse_mesh
from triax.sharding.collective_matmul import overlap_reason
from triax.models.config import ModelConfig
from triax.pipeline.pipelined import PipelineConfig, default_microbatches
from triax.pipeline.schedules import ScheduleKind
from triax.sharding.context import check_scheme
from triax.sharding.rules import Strategy, get_strategy
from triax.training.config import RunConfig
from triax.training.data_source import batch_keys
from triax.training.offload import Offload
from triax.training.step import Trainer
from triax.training.step_cache import Compiled, compiled_for


@dataclass(frozen=True)
class Run:
    """A built run: its config, model, mesh, the pipeline decision and the (cached) step."""

    config: RunConfig
    model: ModelConfig
    mesh: Mesh
    pipeline: Optional[PipelineConfig]   # None: the plain SPMD step
    compiled: Compiled                   # trainer + lazily compiled step, eval and init

    @property
    def trainer(self) -> Trainer:
        return self.compiled.trainer


def build_run(run: RunConfig, cfg: Optional[ModelConfig] = None) -> Run:
    """Mesh, pipeline and trainer for ``run`` (``cfg`` overrides ``run.model_config()``).

    Compiled pieces are shared with earlier runs of the same program in this process.
    """
    cfg = run.model_config() if cfg is None else cfg
    exe = run.exec_config()  # checks --precision and --remat before anything is built
    run.check_model(cfg)
    mesh = build_mesh(run, cfg)
    pipeline = pipeline_for(run, cfg, mesh)
    check_batch(run, mesh, pipeline)
    lay = run.layout
    why = overlap_reason(mesh_sizes(mesh), run_strategy(run).rules) if lay.tp_overlap else None
    if why:
        raise ValueError(f"{why} (mesh {describe(mesh)}, strategy {lay.strategy})")
    compiled = compiled_for(dict(model=cfg, mesh=mesh, strategy=run_strategy(run), pipeline=pipeline,
                                 optim=run.optim_config(), exe=exe,
                                 accum_steps=run.optim.grad_accum,
                                 skip_nonfinite=run.loop.on_nonfinite == "skip",
                                 offload=offload_for(run, cfg, mesh)),
                            run.dataset.batch_size, run.dataset.seq_len,
                            batch_keys(run.dataset.data))
    return Run(run, cfg, mesh, pipeline, compiled)


def run_strategy(run: RunConfig) -> Strategy:
    """``--strategy`` with ``--context-attention`` (the scheme the context axis runs) and
    ``--tp-overlap`` (collective matmuls for sequence parallelism)."""
    return dataclasses.replace(get_strategy(run.layout.strategy),
                               context_attention=check_scheme(run.layout.context_attention),
                               tp_overlap=run.layout.tp_overlap)


def default_mesh(num_devices: int, cfg: ModelConfig) -> dict[str, int]:
    """data × tensor × pipe with tensor=2 and pipe=2 where the devices allow (8 → 2×2×2)."""
    tensor = 2 if num_devices % 2 == 0 and num_devices >= 4 else 1
    pipe = 2 if num_devices % (2 * tensor) == 0 and num_devices >= 8 and cfg.num_layers % 2 == 0 else 1
    return {"data": num_devices // (tensor * pipe), "tensor": tensor, "pipe": pipe}


def build_mesh(run: RunConfig, cfg: ModelConfig) -> Mesh:
    """``--mesh`` (one axis may be -1: the rest), or ``default_mesh``; multi-host aware."""
    n = jax.device_count()
    sizes = parse_mesh(run.layout.mesh) if run.layout.mesh else default_mesh(n, cfg)
    need = math.prod(v for v in sizes.values() if v > 0)
    if need > n:
        raise ValueError(f"--mesh {run.layout.mesh or sizes} needs {need} devices but only {n} "
                         f"exist "
                         f"(JAX sees {n} device(s)); choose sizes whose product is {n}")
    maker = make_hybrid_mesh if jax.process_count() > 1 else make_mesh
    return maker(**sizes)


def pipeline_for(run: RunConfig, cfg: ModelConfig, mesh: Mesh) -> Optional[PipelineConfig]:
    """The one pipelining decision: a schedule when ``pipe > 1``."""
    stages = mesh_sizes(mesh).get("pipe", 1)
    counts = run.check_pipeline(cfg, stages)   # --stage-layers without pipe fails here
    if stages < 2:
        return None
    pp = run.pipeline
    pipeline = PipelineConfig(pp.schedule, pp.microbatches, pp.virtual,
                              pipeline_fsdp_for(run, cfg, mesh), counts)
    pipeline.build(stages)  # a bad schedule/micro-batch combination fails here, not in a compile
    return pipeline


def pipeline_fsdp_for(run: RunConfig, cfg: ModelConfig, mesh: Mesh) -> str:
    """The one home of ``--pipeline-fsdp auto``: ``stage`` (a gather per step: the least
    traffic) where the planner's memory model of that run fits one device's memory
    (``costs.fits.device_capacity``; unknown: assumed to fit), else ``layer`` (FSDP's
    memory, a gather per layer per op). Without FSDP over ``data`` the two are one."""
    if run.pipeline.pipeline_fsdp != "auto":
        return run.pipeline.pipeline_fsdp
    sizes = mesh_sizes(mesh)
    if not get_strategy(run.layout.strategy).fsdp or sizes.get("data", 1) < 2 \
            or not isinstance(cfg, ModelConfig):
        return "stage"
    capacity = device_capacity()
    lay = Layout(**{a: sizes.get(a, 1) for a in ("data", "tensor", "pipe", "expert")},
                 strategy=run.layout.strategy, schedule=ScheduleKind(run.pipeline.schedule),
                 microbatches=run.pipeline.microbatches or default_microbatches(sizes["pipe"]),
                 virtual=run.pipeline.virtual, pipeline_fsdp="stage",
                 stage_layers=run.check_pipeline(cfg, sizes["pipe"]))
    w = Workload.of_run(run, cfg)
    fits = capacity is None or estimate(w, lay).modelled <= capacity[0]
    return "stage" if fits else "layer"


def offload_for(run: RunConfig, cfg: ModelConfig, mesh: Mesh) -> Offload:
    """``--offload``'s parts, with the optimizer update that ``costs.offload`` prices lower
    on this layout (a user's model: streamed, the planner cannot count its parameters)."""
    targets = run.layout.offload_targets()
    if not targets or not isinstance(cfg, ModelConfig):
        return Offload(targets)
    sizes = mesh_sizes(mesh)
    lay = Layout(**{a: sizes.get(a, 1) for a in ("data", "tensor", "pipe", "expert")},
                 strategy=run.layout.strategy)
    return Offload(targets, cheaper_update(Workload.of_run(run, cfg), lay, targets))


def check_batch(run: RunConfig, mesh: Mesh, pipeline: Optional[PipelineConfig] = None) -> None:
    """The global batch must split into data shards × accumulation × pipeline micro-batches."""
    sizes = mesh_sizes(mesh)
    run.check_batch(sizes["data"], 1 if pipeline is None
                    else pipeline.num_microbatches(sizes.get("pipe", 1)))
