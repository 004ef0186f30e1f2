"""Pipeline benchmark: every schedule vs the unpipelined step and a MaxText-style baseline.

Not run in CI. On 8 simulated CPU devices (data=2 x pipe=4) it reports, per schedule and M:
the table's bubble fraction and peak in flight, step time relative to the unpipelined step
(data=8, same global batch) and to the unpipelined step at the same micro-batch size
(data=8 with gradient accumulation over M / 4), the matmul FLOPs per micro-batch measured on the compiled step
relative to 1F1B's (each op's conditional branch, from ``sharding.introspect``, times the
cells of the table that run it), peak per-device memory and temporaries from the compiled
step, the parameter bytes a device holds, and compile time. The baseline runs the same stages as GPipe the way MaxText/praxis
do: ``vmap`` over stages, every stage computing in every tick (bubble included),
differentiated by autodiff through the loop.

    python bench/pipeline.py --model small --layers 8 --seq 8 --batch 64 --steps 2 --write

``--stage-layers 3,2,2,1`` instead compares uneven stages with even 1F1B at each M (its own
section, "## Pipeline: uneven stages"): the table's bubble and the bubble on identical devices
(the short stages idle for the longest), FLOPs per micro-batch read per stage from the compiled
layer slots (``sharding.introspect.slot_flops``), parameter bytes per device (the state's
layout), peak and temporaries.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from tables import BENCHMARKS_MD, write_section  # noqa: E402
from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.models import runtime  # noqa: E402
from triax.models.loss import cross_entropy  # noqa: E402
from triax.models.protocol import run_stack  # noqa: E402
from triax.costs.pipeline_math import microbatch_constraint  # noqa: E402
from triax.pipeline import ScheduleKind, build, chunks_per_stage  # noqa: E402
from triax.pipeline.stage_layers import StageLayers  # noqa: E402
from triax.pipeline.timeline import LABELS  # noqa: E402
from triax.sharding.introspect import memory_from_compiled, op_branch_costs  # noqa: E402
from triax.sharding.introspect.branch_costs import computation_cost  # noqa: E402
from triax.sharding.introspect.hlo_text import compiled_text, parse_module  # noqa: E402
from triax.sharding.introspect.slot_flops import op_slot_conditionals, stage_op_flops  # noqa: E402,E501
from triax.training.config import RunConfig  # noqa: E402
from triax.training.setup import build_run  # noqa: E402
from triax.training.step import Trainer  # noqa: E402
from triax.units import mib  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "allow")
KINDS = {k.value for k in ScheduleKind}
STAGES = 4                           # the pipelined mesh: data=2 x pipe=4


def vmapped_gpipe(trainer: Trainer, M: int):
    """MaxText-style GPipe: all S stages compute every tick (vmap), autodiff through the loop."""
    cfg, mesh, am = trainer.cfg, trainer.mesh, trainer.abstract
    S = dict(zip(mesh.axis_names, mesh.devices.shape))["pipe"]
    layout = StageLayers(cfg.num_layers, S, 1)
    state_sh = NamedSharding(mesh, P("pipe", "data"))

    def loss(params, batch):
        model = nnx.merge(am.graphdef, params)
        B, T = batch["inputs"].shape
        b = B // M
        x = model.embed({"inputs": batch["inputs"]}).reshape(b, M, T, -1).swapaxes(0, 1)
        stages = jax.tree.map(lambda a: a[:, 0], layout.to_stages(params["blocks"]))
        pieces = {k: v for k, v in params.items() if k != "blocks"}
        shape_only = {"inputs": jnp.zeros((b, T), jnp.int32)}   # B, T for the causal mask

        def stage(p, h):
            with runtime.using(constraint=None):
                chunk = nnx.merge(am.graphdef, {**pieces, "blocks": p})
                return run_stack(chunk, h, shape_only, trainer.exe)[0]

        def tick(carry, t):
            state, outs = carry
            inp = jnp.where(t < M, x[jnp.minimum(t, M - 1)], 0.0)
            shifted = jax.lax.with_sharding_constraint(
                jnp.concatenate([inp[None], state[:-1]], 0), state_sh)
            out = jax.vmap(stage)(stages, shifted)
            k = jnp.clip(t - (S - 1), 0, M - 1)
            outs = jnp.where(t >= S - 1, outs.at[k].set(out[-1]), outs)
            return (out, outs), None
        init = (jnp.zeros((S,) + x.shape[1:], x.dtype), jnp.zeros_like(x))
        (_, outs), _ = jax.lax.scan(tick, init, jnp.arange(M + S - 1))
        y = outs.swapaxes(0, 1).reshape(B, T, -1)
        ce = cross_entropy(model.logits(y), batch["targets"])
        return ce, {"ce": ce}
    return lambda p, b: jax.value_and_grad(loss, has_aux=True)(p, b)


def step_flops(compiled, stages: int, schedule=None) -> int:
    """Matmul FLOPs of one step of one data replica (all ``stages`` devices), measured on
    the compiled program. With a ``schedule``: each op kind's conditional branch
    (``op_branch_costs``; the head's conditional at its costliest branch on the last
    chunk's cells, its cheapest elsewhere) times the table's cells that run it, plus what
    runs outside the ops on every stage. Without (the vmap baseline, which has no op
    conditionals): the whole program on every stage."""
    text = compiled_text(compiled)
    m = parse_module(text)
    total = stages * computation_cost(m, m.entry).flops   # the ops' conditionals kept apart
    if schedule is None:
        return total
    ops = op_branch_costs(text)
    last = schedule.num_chunks - 1
    for row in schedule.table:
        # F&B's branch runs exactly its F's and B's matmuls (tests/test_dualpipe_v.py):
        # each part is priced by its own branch, its head counted where its chunk is last.
        for op in (part for cell in row if cell is not None for part in cell.parts()):
            c = ops[LABELS[op.kind]]
            total += (c.costliest() if op.chunk == last else c.cheapest()).flops
    return total


def uneven_step_flops(compiled, schedule, counts) -> int:
    """:func:`step_flops` for uneven stages: an op's layer slots (nested conditionals, which
    ``op_branch_costs`` keeps apart) counted per stage, each stage running ``counts[s]``
    of its ``max(counts)`` slots (``slot_flops.stage_op_flops``)."""
    text = compiled_text(compiled)
    m = parse_module(text)
    S = len(counts)
    total = S * computation_cost(m, m.entry).flops
    ops, slots = op_branch_costs(text), stage_op_flops(text, counts, max(counts))
    # The head's conditional on the last chunk: the costliest branches less the slots' (each
    # slot conditional counts once at its run branch in ``Cost.costliest``).
    runs = {k: sum(sc.run.flops - sc.skip.flops for sc in v[1])
            for k, v in op_slot_conditionals(text).items()}
    last = schedule.num_chunks - 1
    for row in schedule.table:
        for op in row:
            if op is None:
                continue
            c, label = ops[LABELS[op.kind]], LABELS[op.kind]
            head = (c.costliest().flops - c.cheapest().flops - runs.get(label, 0)
                    if op.chunk == last else 0)
            total += (slots[label][op.chunk] if label in slots else c.cheapest().flops) + head
    return total


def param_bytes(trainer: Trainer) -> int:
    """Per-device bytes of the train state's parameters, as the step's input shardings lay
    them out."""
    return sum(int(np.prod(s.sharding.shard_shape(s.shape))) * s.dtype.itemsize
               for s in jax.tree.leaves(trainer.abstract_state()["params"]))


def measure(trainer: Trainer, batch, steps: int) -> dict:
    t0 = time.perf_counter()
    compiled = trainer._jitted_step.lower(trainer.abstract_state(), {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding())
        for k, v in batch.items()}).compile()
    compile_s = time.perf_counter() - t0
    mem = memory_from_compiled(compiled)
    state = trainer.init(0)
    batch = trainer.shard_batch(batch)
    state, m = compiled(state, batch)  # warm-up
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    peak = mem.argument_bytes + mem.output_bytes + mem.temp_bytes - mem.alias_bytes
    return {"step_s": float(np.min(times)), "compile_s": compile_s, "peak_mb": mib(peak),
            "param_mb": mib(param_bytes(trainer)),
            "temp_mb": mib(mem.temp_bytes), "loss": float(m["loss"]), "compiled": compiled}


def run(args) -> list[dict]:
    cfg = config.get(args.model, args.layers)

    def trainer(mesh: str, **pipeline) -> Trainer:
        return build_run(RunConfig.of(model=cfg.name, num_layers=cfg.num_layers, mesh=mesh,
                                      strategy="dp", batch_size=args.batch, seq_len=args.seq,
                                      **pipeline), cfg).trainer
    ref = trainer("data=8")
    batch = ref.example_batch(args.batch, args.seq)
    base = measure(ref, batch, args.steps)
    print(f"unpipelined data=8: {base}", file=sys.stderr)
    # The unpipelined step at the pipeline's micro-batch size: data=8 with gradient
    # accumulation over M / S micro-steps runs each layer's matmuls on as many tokens as a
    # pipelined op does, as many times per device; what the pipeline costs beyond it is the
    # executor's, not the matmuls' granularity.
    same_size = {1: base}
    for M in args.ms:
        A = M // STAGES
        if A > 1 and A not in same_size:
            same_size[A] = measure(trainer("data=8", grad_accum=A), batch, args.steps)
            np.testing.assert_allclose(same_size[A]["loss"], base["loss"], rtol=1e-4)
            print(f"unpipelined data=8 grad-accum {A}: {same_size[A]}", file=sys.stderr)
    rows = []
    mesh = make_mesh(data=8 // STAGES, pipe=STAGES)
    for M in args.ms:
        for kind in args.schedules:
            v = 2 if kind == "interleaved" else chunks_per_stage(kind) if kind in KINDS else 1
            if kind in KINDS and microbatch_constraint(ScheduleKind(kind), STAGES, M, v):
                print(f"{kind} M={M}: {microbatch_constraint(ScheduleKind(kind), STAGES, M, v)}",
                      file=sys.stderr)     # DualPipeV needs M >= 2S
                continue
            if kind == "maxtext-vmap":   # the baseline brings its own loss_and_grad
                # The same run (optimizer and its schedule included) with GPipe's stages.
                tr = trainer(f"data={8 // STAGES},pipe={STAGES}", schedule="gpipe",
                             microbatches=M)
                tr = Trainer(cfg, mesh, tr.strategy, optim=tr.optim, exe=tr.exe,
                             loss_and_grad=vmapped_gpipe(tr, M))
                sched, table = None, build("gpipe", STAGES, M)
                in_flight = M                # autodiff keeps every tick's residuals
            else:
                tr = trainer(f"data={8 // STAGES},pipe={STAGES}", schedule=kind,
                             microbatches=M, virtual=v)
                sched = table = tr.pipeline.schedule
                in_flight = sched.peak_in_flight / sched.virtual   # in whole stages
            r = measure(tr, batch, args.steps)
            same = same_size.get(M // STAGES)
            r.update(kind=kind, M=M, v=v, bubble=table.bubble_fraction(), in_flight=in_flight,
                     ratio=r["step_s"] / base["step_s"],
                     same_ratio=None if same is None else r["step_s"] / same["step_s"],
                     flops_mb=step_flops(r.pop("compiled"), STAGES, sched) / M)
            np.testing.assert_allclose(r["loss"], base["loss"], rtol=1e-4)
            print(r, file=sys.stderr)
            rows.append(r)
    ofob = {r["M"]: r["flops_mb"] for r in rows if r["kind"] == "1f1b"}
    for r in rows:
        r["flops_ratio"] = r["flops_mb"] / ofob[r["M"]] if r["M"] in ofob else None
    refs = []
    for A, r in same_size.items():
        r.pop("compiled")
        refs.append(dict(kind="unpipelined (data=8)" + (f", grad-accum {A}" if A > 1 else ""),
                         M=1, accum=A, v=1, bubble=0.0, ratio=r["step_s"] / base["step_s"],
                         same_ratio=None, in_flight=None, flops_ratio=None, **r))
    return refs + rows


def run_uneven(args) -> list[dict]:
    """1F1B with even stages and with ``args.stage_layers``, per M, on data=2 x pipe=4."""
    cfg = config.get(args.model, args.layers)
    counts = tuple(int(c) for c in args.stage_layers.split(","))
    mesh = f"data={8 // STAGES},pipe={STAGES}"

    def trainer(**kw) -> Trainer:
        return build_run(RunConfig.of(model=cfg.name, num_layers=cfg.num_layers, mesh=mesh,
                                      strategy="dp", batch_size=args.batch, seq_len=args.seq,
                                      **kw), cfg).trainer
    rows = []
    for M in args.ms:
        for layers in (None, counts):
            tr = trainer(schedule="1f1b", microbatches=M,
                         stage_layers=layers and ",".join(map(str, layers)))
            batch = tr.example_batch(args.batch, args.seq)
            sched = tr.pipeline.schedule
            r = measure(tr, batch, args.steps)
            compiled = r.pop("compiled")
            flops = step_flops(compiled, STAGES, sched) if layers is None else \
                uneven_step_flops(compiled, sched, layers)
            b = sched.bubble_fraction()
            per = layers or (cfg.num_layers // STAGES,) * STAGES
            r.update(layers=",".join(map(str, per)), M=M, bubble=b, flops_mb=flops / M,
                     idle=1 - (1 - b) * (sum(per) / len(per)) / max(per))
            print(r, file=sys.stderr)
            rows.append(r)
    for r in rows:
        even = next(e for e in rows if e["M"] == r["M"])
        np.testing.assert_allclose(r["loss"], even["loss"], rtol=1e-4)
        r["flops_ratio"] = r["flops_mb"] / even["flops_mb"]
    return rows


def uneven_table(rows, args) -> str:
    cmd = ("python bench/pipeline.py --model {} --layers {} --seq {} --batch {} --steps {} "
           "--ms {} --stage-layers {}").format(args.model, args.layers, args.seq, args.batch,
                                                args.steps, ",".join(map(str, args.ms)),
                                                args.stage_layers)
    head = ["## Pipeline: uneven stages", "",
            f"`{cmd} --write` — 1F1B on data=2 x pipe=4 (8 simulated CPU devices), even "
            f"stages against stages of {args.stage_layers} layers, global batch {args.batch} "
            f"x {args.seq} tokens. The table's bubble is the schedule's; on identical devices "
            "the short stages also idle while the longest works (1 − (1 − bubble) × mean / "
            "max layers): uneven stages pay off only where the devices differ (mixed "
            "generations, `planner.mixed`). FLOPs are the compiled program's matmuls, each "
            "stage's layer slots counted as that stage runs them (skipped slots cost no "
            "matmul); parameter MB are per device, as the state is laid out (each pipe rank "
            "holds its own stage, padded to the longest).", "",
            "| stage layers | M | bubble (table) | bubble on identical devices | step s | "
            "FLOPs per micro-batch / even | param MB/device | peak MB/device | temp MB | "
            "compile s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    body = [f"| {r['layers']} | {r['M']} | {r['bubble']:.3f} | {r['idle']:.3f} | "
            f"{r['step_s']:.1f} | {r['flops_ratio']:.3f} | {r['param_mb']:.1f} | "
            f"{r['peak_mb']:.1f} | {r['temp_mb']:.1f} | {r['compile_s']:.1f} |" for r in rows]
    return "\n".join(head + body) + "\n"


def table(rows, args) -> str:
    cmd = ("python bench/pipeline.py --model {} --layers {} --seq {} "
           "--batch {} --steps {}").format(args.model, args.layers, args.seq, args.batch,
                                          args.steps)
    head = ["## Pipeline", "",
            f"`{cmd} --write` — {args.model} preset with {args.layers} layers (the full 12 are "
            f"too slow on this shared 2-core machine), global batch {args.batch} x {args.seq} "
            f"tokens, 8 simulated CPU devices: pipelined runs on data=2 x pipe=4, the "
            f"unpipelined reference on data=8. Step time is the fastest of {args.steps} steps "
            "after a warm-up (the machine is shared, so slower repeats measure other load). Simulated devices share the same CPU cores, so a ratio measures "
            "total work plus overhead: bubble ticks that compute (the vmap baseline) cost "
            "real time here, skipped ones (triax) do not.", "",
            "\"Same-size\" divides by the unpipelined step whose micro-steps (gradient "
            "accumulation over M / 4) give each matmul the tokens a pipelined op's get: what "
            "the pipeline costs beyond the matmuls' granularity.", "",
            "| schedule | M | tokens per micro-batch and data rank | bubble | peak in flight "
            "(stages) | step s | step time / unpipelined | step time / same-size unpipelined "
            "| FLOPs per micro-batch / 1F1B | peak MB/device | temp MB | param MB/device "
            "| compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    # What one op's matmuls see: where it is a few rows, dispatch dominates the matmul.
    tokens = lambda r: (args.batch // 8 // r["accum"] if r["M"] == 1  # noqa: E731
                        else args.batch // (8 // STAGES) // r["M"]) * args.seq
    body = [f"| {r['kind']}{' v=2' if r['v'] > 1 else ''} | {r['M']} | {tokens(r)} | "
            f"{r['bubble']:.3f} | "
            f"{dash(r['in_flight'], 'g')} | {r['step_s']:.1f} | {r['ratio']:.2f} | "
            f"{dash(r['same_ratio'], '.2f')} | "
            f"{dash(r['flops_ratio'], '.3f')} | {r['peak_mb']:.1f} | {r['temp_mb']:.1f} | "
            f"{r['param_mb']:.1f} | {r['compile_s']:.1f} |" for r in rows]
    return "\n".join(head + body) + "\n"


def dash(x, f: str) -> str:
    return "—" if x is None else format(x, f)


def targets(rows) -> list[str]:
    """Issue 11's per-tick-tax targets, where the run measured them: at a fixed global batch,
    1F1B at M=32 over M=4 (<= 1.3) and 1F1B over the unpipelined step at M = 4S (<= 1.15)."""
    step = {(r["kind"], r["M"]): r for r in rows}
    out = []
    if ("1f1b", 4) in step and ("1f1b", 32) in step:
        out.append(f"1f1b step M=32 / M=4: "
                   f"{step[('1f1b', 32)]['step_s'] / step[('1f1b', 4)]['step_s']:.2f} "
                   f"(target <= 1.3)")
    if ("1f1b", 16) in step:   # S = 4
        out.append(f"1f1b / unpipelined at M=4S=16: {step[('1f1b', 16)]['ratio']:.2f} "
                   f"(target <= 1.15); / the same-size unpipelined step: "
                   f"{dash(step[('1f1b', 16)]['same_ratio'], '.2f')}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ms", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16, 32])
    p.add_argument("--schedules", type=lambda s: s.split(","),
                   default=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev",
                            "maxtext-vmap"])
    p.add_argument("--stage-layers", default=None,
                   help="uneven stages, e.g. 3,2,2,1: compare them with even 1F1B instead")
    p.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.stage_layers:
        md = uneven_table(run_uneven(args), args)
        print(md)
        if args.write:
            write_section(BENCHMARKS_MD, "## Pipeline: uneven stages", md)
        return
    rows = run(args)
    md = table(rows, args)
    print(md)
    print("\n".join(targets(rows)))
    if args.write:
        write_section(BENCHMARKS_MD, "## Pipeline", md)


if __name__ == "__main__":
    main()
