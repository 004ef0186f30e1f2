"""``triax plan``: will it fit, on how many GPUs, split how, at what cost; ``--verify``
checks the top plans by compiling them on simulated CPU devices.

    triax plan --model llama3-70b --inference --gpu h100-80gb --gpus-per-node 8 --nodes 1
    triax plan --params 7e9 --train --gpu a100-40gb --gpus-per-node 8 --nodes 2 --json
    triax plan --model llama3-8b --train --seq-len 131072 --gpu h100-80gb --gpus-per-node 8 \
        --nodes 4 --mesh data=8,context=4 --strategy fsdp --context-attention ring
    triax plan --model llama3-8b --train --batch-size 32 --remat full \
        --gpu h100-80gb:8,a100-80gb:8        # mixed generations: uneven pipeline stages
"""
from __future__ import annotations

import json

from triax.cli.flags import add_flags, add_json
from triax import choices
from triax.cli.common import start_devices
from triax.cli.run_flags import add_run_flags
from triax.config_fields import KVPool
from triax.pipeline.schedules import ScheduleKind   # JAX-free, as training.config needs

RUN_FLAGS = ("batch_size", "seq_len", "num_layers", "max_seq_len", "mesh", "strategy", "remat",
             "loss_chunks", "context_attention", "attention", "lora_rank", "lora_alpha",
             "lora_targets", "base_dtype")
PLAN_DEFAULTS = {"batch_size": 8, "seq_len": 2048, "mesh": None, "strategy": None,
                 "context_attention": None}
PLAN_NOTES = {
    "mesh": "here the mesh to evaluate, axes left out are 1 and no -1 (default: search)",
    "strategy": "the strategy for --mesh",
    "loss_chunks": "for --mesh, or tried beside the search's own choice for long sequences",
    "context_attention": "the scheme for --mesh with context > 1; without --mesh, the only "
                         "scheme searched (default: both)",
    "kv_blocks": "with --inference: the pool the KV term counts (default: --kv-memory's, else "
                 "--batch-size slots × --seq-len's blocks)",
}


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="recommend a mesh and strategy; memory, comm and time")
    what = p.add_mutually_exclusive_group(required=True)
    add_run_flags(what, ["model"], {"model": None}, fill=True)
    what.add_argument("--params", type=float, help="parameter count for a quick estimate")
    what.add_argument("--model-dir", metavar="DIR", help="Hugging Face model directory (its "
                      "config.json; no weights are read)")
    p.add_argument("--dtype", choices=tuple(choices.PRECISIONS), default="bf16")
    job = p.add_mutually_exclusive_group(required=True)
    job.add_argument("--train", action="store_true")
    job.add_argument("--inference", action="store_true")
    p.add_argument("--gpu", required=True, help="device kind, e.g. h100-80gb; or mixed "
                   "generations as KIND:COUNT groups, e.g. h100-80gb:8,a100-80gb:8 (one "
                   "pipeline stage per group, layers sized by speed; docs/planner.md)")
    p.add_argument("--gpus-per-node", type=int, help="with one --gpu kind (required there)")
    p.add_argument("--nodes", type=int, help="with one --gpu kind (required there)")
    # The flags a run shares, from RunConfig's fields (one help, one set of choices); a
    # plan's defaults: a search over meshes and strategies, at a longer sequence.
    add_run_flags(p, RUN_FLAGS, PLAN_DEFAULTS, notes=PLAN_NOTES, fill=True)
    add_flags(p, KVPool, notes={"kv_blocks": PLAN_NOTES["kv_blocks"]}, fill=True)
    # Not RunConfig's: a plan may be for inference (forward-only), and its micro-batches
    # default to 1 where a run's 0 means 2 × pipe.
    p.add_argument("--schedule", choices=tuple(k.value for k in ScheduleKind),
                   help="pipeline schedule for --mesh with pipe > 1")
    p.add_argument("--microbatches", type=int, help="micro-batches for --mesh with pipe > 1")
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--verify", action="store_true",
                   help="compile the top plans on simulated CPU devices and compare")
    p.add_argument("--hardware", help="TOML file of extra devices, links and clusters")
    add_json(p)
    p.set_defaults(func=run)


def _layout(args):
    # Imported here: triax.mesh and the rules load JAX, which must first see the simulated
    # device count (run() sets it).
    from triax.mesh import parse_mesh
    from triax.planner.workload import Layout
    from triax.sharding.rules import get_strategy
    if args.mesh is None:
        if args.strategy or args.schedule:
            raise ValueError("--strategy/--schedule go with --mesh (e.g. --mesh data=2,tensor=4)")
        return None
    if not args.strategy:
        raise ValueError(f"--mesh needs --strategy ({', '.join(choices.STRATEGIES)})")
    get_strategy(args.strategy)
    sizes = parse_mesh(args.mesh)
    if any(v < 1 for v in sizes.values()):
        raise ValueError(f"--mesh sizes must be ≥ 1 (no -1 fill in a plan): {args.mesh}")
    sched = ScheduleKind.parse(args.schedule) if args.schedule else None
    return Layout(**sizes, strategy=args.strategy, schedule=sched,
                  microbatches=args.microbatches or 1,
                  virtual=2 if sched is ScheduleKind.INTERLEAVED else 1,
                  context_attention=args.context_attention or "all-gather")


def _pool(args) -> dict:
    """``--kv-blocks`` / ``--kv-memory`` / ``--kv-block-size`` as ``Workload`` takes them:
    serving's pool (checked as serve checks them), for ``--inference`` only."""
    from triax.cli.serving_flags import pool_of
    given = [f for f in ("kv_blocks", "kv_memory") if getattr(args, f) is not None]
    if args.train and given:
        raise ValueError(f"--{given[0].replace('_', '-')} sizes serving's KV pool: plan it "
                         f"with --inference, or drop it for --train")
    pool = pool_of(args)
    return {"kv_blocks": pool["kv_blocks"], "kv_memory": pool["kv_memory"],
            "kv_block_size": pool["block_size"]}


def run(args) -> int:
    # The planner compiles a small pipelined step to measure op costs (planner.op_costs),
    # which needs simulated CPU devices: set before anything starts JAX's backend.
    start_devices()
    from triax.models import config
    from triax.planner import hardware
    from triax.planner.recommend import plan
    from triax.planner.plan_table import text_report
    from triax.planner.workload import Workload

    cat = hardware.load_catalog(args.hardware)
    mixed = ":" in args.gpu
    if not mixed and (args.gpus_per_node is None or args.nodes is None):
        raise ValueError(f"--gpu {args.gpu} needs --gpus-per-node and --nodes (or give "
                         f"KIND:COUNT groups for mixed generations, e.g. "
                         f"h100-80gb:8,a100-80gb:8)")
    cluster = None if mixed else cat.cluster(args.gpu, args.gpus_per_node, args.nodes)
    cfg = config.get(args.model, args.num_layers) if args.model else None
    if args.model_dir:
        from triax.hf.load import read_model_config
        cfg = read_model_config(args.model_dir)
        cfg = cfg if args.num_layers is None else cfg.replace(num_layers=args.num_layers)
    if cfg is not None and args.max_seq_len is not None:
        cfg = cfg.replace(max_seq_len=args.max_seq_len)
    if args.lora_rank:   # adapters as a run would build them (RunConfig.lora_config)
        from triax.training.config import RunConfig
        if cfg is None:
            raise ValueError("--lora-rank needs a model (--model or --model-dir), not --params")
        cfg = cfg.replace(lora=RunConfig(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                                         lora_targets=args.lora_targets,
                                         base_dtype=args.base_dtype).lora_config())
    w = Workload.of(cfg, int(args.params) if args.params else None, train=args.train,
                    dtype=args.dtype, batch=args.batch_size, seq=args.seq_len,
                    remat=args.remat, attention=args.attention, loss_chunks=args.loss_chunks,
                    **_pool(args))
    if mixed:
        return _mixed(args, w, cat)
    schemes = (args.context_attention,) if args.context_attention else choices.CONTEXT_SCHEMES
    rec = plan(w, cluster, top=args.top, layout=_layout(args), schemes=schemes)
    out = rec.to_json()
    if args.verify:
        from triax.planner.verify import verify
        out["verify"] = [verify(p.workload, p.layout) for p in rec.plans]
    print(json.dumps(out, indent=2) if args.json else text_report(rec, out.get("verify")))
    return 0


def _mixed(args, w, cat) -> int:
    """Mixed generations (``planner.mixed``): the uneven split against equal stages."""
    from triax.planner.hardware import parse_gpu
    from triax.planner.mixed import plan_mixed
    if args.mesh is not None:
        raise ValueError("--mesh does not go with mixed --gpu groups: the stages are the "
                         "groups (each stage's devices its data axis)")
    m = plan_mixed(w, parse_gpu(args.gpu, cat), args.strategy or "fsdp",
                   ScheduleKind.parse(args.schedule or "1f1b"), args.microbatches, cat)
    print(json.dumps(m.to_json(), indent=2) if args.json else m.describe())
    return 0
