"""``triax plan``: will it fit, on how many GPUs, split how, at what cost; ``--verify``
checks the top plans by compiling them on simulated CPU devices. Its flags are
``RunConfig``'s (with train's defaults; the layout is searched unless given) and
``PlanConfig``'s (the devices, what to size, how much to show).

    triax plan                  # tiny, train's defaults, on the devices present
    triax plan --model llama3-70b --inference --gpu h100-80gb --gpus-per-node 8 --nodes 1
    triax plan --params 7e9 --train --gpu a100-40gb --gpus-per-node 8 --nodes 2 --json
    triax plan --model llama3-8b --train --seq-len 131072 --gpu h100-80gb --gpus-per-node 8 \\
        --nodes 4 --mesh data=8,context=4 --strategy fsdp --context-attention ring
    triax plan --model llama3-8b --train --batch-size 32 --remat full \\
        --gpu h100-80gb:8,a100-80gb:8        # mixed generations: uneven pipeline stages
"""
from __future__ import annotations

import dataclasses

import argparse
import json
from typing import NamedTuple, Optional

from triax import choices
from triax.cli.common import start_devices
from triax.cli.flags import add_flags, add_json, given
from triax.cli.plan_config import PlanConfig
from triax.cli.run_flags import add_run_flags
from triax.config_fields import KVPool
from triax.pipeline.schedules import ScheduleKind   # JAX-free, as training.config needs
from triax.training.config import RunConfig, RunConfigWarning
from triax.configs import warn_inert
from triax.training.inert import inert_flags

# The run's fields a plan sizes; their defaults are train's (RunConfig's), but for the
# layout, which a plan searches unless given.
RUN_FLAGS = ("batch_size", "seq_len", "precision", "num_layers", "max_seq_len", "mesh",
             "strategy", "remat", "loss_chunks", "context_attention", "attention", "lora_rank",
             "lora_alpha", "lora_targets", "base_dtype", "device_memory", "offload")
SEARCHED = ("mesh", "strategy", "context_attention")
PLAN_NOTES = {
    "mesh": "here the mesh to evaluate, axes left out are 1 and no -1 (default: search)",
    "strategy": "the strategy for --mesh",
    "loss_chunks": "for --mesh, or tried beside the search's own choice for long sequences",
    "context_attention": "the scheme for --mesh with context > 1; without --mesh, the only "
                         "scheme searched (default: both)",
    "device_memory": "without --gpu, each present device's (default: the device's own, "
                     "$TRIAX_DEVICE_MEMORY, or host memory ÷ simulated devices)",
    "kv_blocks": "with --inference: the pool the KV term counts (default: --kv-memory's, else "
                 "--batch-size slots × --seq-len's blocks)",
    "offload": "every plan keeps these parts on the host: its host bytes and host-link time "
               "per step are shown (the search then offers unpipelined plans only)",
}


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="recommend a mesh and strategy; memory, comm and time",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group()
    add_run_flags(what, ["model"])
    add_flags(what, PlanConfig, ["params", "model_dir"])
    job = p.add_mutually_exclusive_group()
    add_flags(job, PlanConfig, ["train", "inference"])
    add_flags(p, PlanConfig, ["gpu", "gpus_per_node", "nodes"])
    add_run_flags(p, RUN_FLAGS, notes=PLAN_NOTES, aliases={"precision": ("--dtype",)})
    add_flags(p, KVPool, notes={"kv_blocks": PLAN_NOTES["kv_blocks"]})
    add_flags(p, PlanConfig, ["speculative_tokens", "acceptance_rate", "draft_model"])
    add_flags(p, PlanConfig, ["schedule", "microbatches", "top", "verify", "hardware"])
    add_json(p)
    p.set_defaults(func=run)


class Inputs(NamedTuple):
    run: RunConfig          # train's defaults under the flags given
    plan: PlanConfig        # the plan's own settings
    pool: KVPool
    layout: dict            # the layout flags given (a plan searches the rest)
    model: Optional[str]    # None with --params / --model-dir


def plan_inputs(args) -> Inputs:
    """What the flags ask a plan for (each checked by its config)."""
    run_given, pc = given(args, RunConfig), PlanConfig(**given(args, PlanConfig))
    model = run_given.pop("model", None if pc.params or pc.model_dir else "tiny")
    layout = {k: run_given.pop(k) for k in SEARCHED if k in run_given}
    pool = KVPool(**given(args, KVPool))
    if not pc.inference and pool.given():
        raise ValueError(f"{pool.given()[0]} sizes serving's KV pool: plan it with "
                         f"--inference, or drop it for --train")
    run = RunConfig.of(**run_given)
    warn_inert(inert_flags(run, run_given), RunConfigWarning)
    return Inputs(run, pc, pool, layout, model)


def _layout(inp: Inputs):
    # Imported here: triax.mesh and the rules load JAX, which must first see the simulated
    # device count (run() sets it).
    from triax.mesh import parse_mesh
    from triax.costs.workload import Layout
    from triax.sharding.rules import get_strategy
    mesh, strategy, pc = inp.layout.get("mesh"), inp.layout.get("strategy"), inp.plan
    if mesh is None:
        if strategy or pc.schedule:
            raise ValueError("--strategy/--schedule go with --mesh (e.g. --mesh data=2,tensor=4)")
        return None
    if not strategy:
        raise ValueError(f"--mesh needs --strategy ({', '.join(choices.STRATEGIES)})")
    get_strategy(strategy)
    sizes = parse_mesh(mesh)
    if any(v < 1 for v in sizes.values()):
        raise ValueError(f"--mesh sizes must be ≥ 1 (no -1 fill in a plan): {mesh}")
    sched = ScheduleKind.parse(pc.schedule) if pc.schedule else None
    return Layout(**sizes, strategy=strategy, schedule=sched,
                  microbatches=pc.microbatches or 1,
                  virtual=2 if sched is ScheduleKind.INTERLEAVED else 1,
                  context_attention=inp.layout.get("context_attention") or "all-gather")


def _model_config(inp: Inputs):
    """The model planned for (None with ``--params``), adapters as a run builds them."""
    from triax.models import config
    run = inp.run
    cfg = config.get(inp.model, run.source.num_layers) if inp.model else None
    if inp.plan.model_dir:
        from triax.hf.load import read_model_config
        cfg = read_model_config(inp.plan.model_dir)
        cfg = cfg if run.source.num_layers is None else cfg.replace(
            num_layers=run.source.num_layers)
    if cfg is not None and run.source.max_seq_len is not None:
        cfg = cfg.replace(max_seq_len=run.source.max_seq_len)
    if run.lora.lora_rank:   # adapters as a run would build them (Lora.lora_config)
        if cfg is None:
            raise ValueError("--lora-rank needs a model (--model or --model-dir), not --params")
        cfg = cfg.replace(lora=run.lora.lora_config())
    return cfg


def present_devices(cat, device_memory: Optional[str]):
    """This process's devices as a cluster, each with the memory the memory check counts
    (``training.memory_check.device_capacity``), and the notes the report prints."""
    import jax

    from triax.costs import hardware
    from triax.costs.fits import device_capacity
    from triax.planner.auto import REFERENCE_DEVICE, catalogue_device
    from triax.units import human_bytes
    kind = jax.devices()[0].device_kind
    cap = device_capacity(device_memory)
    if cap is None:
        raise ValueError(f"the {kind} reports no memory limit; give --device-memory, e.g. "
                         f"--device-memory 40GiB, or plan for a catalogue kind with --gpu")
    cluster, speeds = hardware.present(cat, kind, catalogue_device(kind, cat), REFERENCE_DEVICE,
                                       jax.local_device_count(), jax.process_count(), cap[0])
    return cluster, (f"devices: the {cluster.devices} present, {human_bytes(cap[0])} each "
                     f"({cap[1]})", f"time model: {speeds}")


def run(args) -> int:
    inp = plan_inputs(args)
    # The planner compiles a small pipelined step to measure op costs (planner.op_costs),
    # which needs simulated CPU devices: set before anything starts JAX's backend.
    start_devices()
    from triax.costs import hardware
    from triax.costs.workload import Workload
    from triax.inference.pool_settings import PoolSettings
    from triax.planner.plan_table import text_report
    from triax.planner.recommend import plan

    run_cfg, pc = inp.run, inp.plan
    cat = hardware.load_catalog(pc.hardware)
    w = Workload.of_run(run_cfg, _model_config(inp), train=not pc.inference,
                        params=int(pc.params) if pc.params else None,
                        pool=PoolSettings.of(inp.pool))
    if pc.speculative_tokens or pc.draft_model:   # speculative decoding (costs.speculative)
        from triax.models import config as presets
        w = dataclasses.replace(w, spec_k=pc.speculative_tokens or 4,
                                acceptance=pc.acceptance_rate,
                                draft=presets.get(pc.draft_model) if pc.draft_model else None)
    if pc.gpu and ":" in pc.gpu:
        return _mixed(args, inp, w, cat)
    if pc.gpu:
        cluster, notes = cat.cluster(pc.gpu, pc.gpus_per_node, pc.nodes), ()
    else:
        cluster, notes = present_devices(cat, run_cfg.planner.device_memory)
    ctx = inp.layout.get("context_attention")
    rec = plan(w, cluster, top=pc.top, layout=_layout(inp),
               schemes=(ctx,) if ctx else choices.CONTEXT_SCHEMES,
               offload=run_cfg.layout.offload_targets())
    out = rec.to_json()
    if pc.verify:
        from triax.planner.verify import verify
        out["verify"] = [verify(p.workload, p.layout) for p in rec.plans]
    print(json.dumps(out, indent=2) if args.json else text_report(rec, out.get("verify"), notes))
    return 0


def _mixed(args, inp: Inputs, w, cat) -> int:
    """Mixed generations (``planner.mixed``): the uneven split against equal stages."""
    from triax.costs.hardware import parse_gpu
    from triax.planner.mixed import plan_mixed
    pc = inp.plan
    if "mesh" in inp.layout:
        raise ValueError("--mesh does not go with mixed --gpu groups: the stages are the "
                         "groups (each stage's devices its data axis)")
    if inp.run.layout.offload:
        raise ValueError("--offload is not planned for mixed --gpu groups (pipelined "
                         "stages); plan it with one --gpu kind")
    m = plan_mixed(w, parse_gpu(pc.gpu, cat), inp.layout.get("strategy") or "fsdp",
                   ScheduleKind.parse(pc.schedule or "1f1b"), pc.microbatches, cat)
    print(json.dumps(m.to_json(), indent=2) if args.json else m.describe())
    return 0
