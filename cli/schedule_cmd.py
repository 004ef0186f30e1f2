"""``triax schedule``: build a pipeline schedule and print its facts (no JAX needed).

    triax schedule --kind zb-h1 --stages 4 --microbatches 8 --json
    triax schedule --kind interleaved --stages 4 --microbatches 8 --virtual 2 --png il.png
    triax schedule --kind zb-v --stages 4 --microbatches 8 --png zbv.png
    triax schedule dualpipev --stages 4 --microbatches 8 --table
"""
from __future__ import annotations

import argparse
import json

from triax.cli.flags import add_json
from triax.pipeline import build
from triax.pipeline.bounds import bubble_lower_bound
from triax.pipeline.schedules import ScheduleKind


def add_parser(sub) -> None:
    p = sub.add_parser("schedule", help="a pipeline schedule's tick table, bubble and memory",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    kinds = [k.value for k in ScheduleKind]
    p.add_argument("schedule", nargs="?", choices=kinds,
                   help="the schedule (the same as --kind; either one)")
    p.add_argument("--kind", default="1f1b", choices=kinds)
    p.add_argument("--stages", type=int, required=True, help="pipeline stages S")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches M")
    p.add_argument("--virtual", type=int, default=1, help="chunks per stage (interleaved; zb-v always runs 2, in a V)")
    add_json(p, "machine-readable facts")
    p.add_argument("--png", metavar="FILE", help="save the timeline (.png or .svg)")
    p.add_argument("--table", action="store_true", help="also print the tick table")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.schedule and args.kind not in ("1f1b", args.schedule):
        raise SystemExit(f"triax schedule: {args.schedule!r} and --kind {args.kind!r} name "
                         f"two schedules; give one")
    sched = build(args.schedule or args.kind, args.stages, args.microbatches, args.virtual)
    facts = sched.summary()
    facts["bubble_lower_bound"] = bubble_lower_bound(sched)
    if args.png:
        from triax.pipeline.timeline import save
        facts["png"] = str(save(sched, args.png))
    if args.json:
        print(json.dumps(facts, indent=2))
    else:
        closed = facts["closed_form_bubble"]
        print(f"{sched.kind.value}: S={sched.stages} M={sched.microbatches} v={sched.virtual}\n"
              f"  ticks            {sched.ticks}\n"
              f"  bubble fraction  {facts['bubble_fraction']:.4f} "
              f"(costs F=1, B_in=1, W=1, B=2, F&B=3)"
              + ("" if closed is None else f"; closed form {closed:.4f}") + "\n"
              f"  least bubble     {facts['bubble_lower_bound']:.4f} (any placement of these "
              f"ops, pipeline.bounds)\n"
              f"  peak in flight   {sched.peak_in_flight} micro-batch chunk(s) per stage")
        if args.png:
            print(f"  timeline         {facts['png']}")
    if args.table:
        print(sched)
    return 0
