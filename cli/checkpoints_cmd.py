"""``triax checkpoints DIR``: list the checkpoints in a directory (step, size, mesh, config).

    triax checkpoints ckpt/            # table
    triax checkpoints ckpt/ --json     # one object per step
    triax checkpoints ckpt/ --verify   # read every step back and check its array checksums;
                                       # exit status 1 if any step is damaged
"""
from __future__ import annotations

import json
import os
from typing import Optional

from triax.cli.flags import add_json
from triax.training.config import saved_values   # JAX-free
from triax.units import human_bytes


def add_parser(sub) -> None:
    p = sub.add_parser("checkpoints", help="list checkpoints: steps, sizes, mesh, config",
                       description=__doc__)
    p.add_argument("directory", help="a --checkpoint-dir of triax train")
    add_json(p, "print JSON instead of a table")
    p.add_argument("--verify", action="store_true",
                   help="read every step's arrays back and check their checksums")
    p.set_defaults(func=run)


def list_checkpoints(directory: str, verify: bool = False) -> list[dict]:
    """One dict per committed step (partial saves are not listed); ``verify`` adds
    ``"intact"`` (and ``"error"`` when it is not) from reading every array back."""
    # Loaded only now: Orbax loads JAX, which must not start while the parser is built.
    from triax.checkpoint import CheckpointError, Checkpointer
    rows = []
    with Checkpointer.existing(directory) as ckpt:
        for step in ckpt.steps():
            row = {"step": step, "bytes": ckpt.step_size_bytes(step)}
            try:
                meta = ckpt.read_meta(step)
            except CheckpointError as e:
                row["error"] = str(e)
            else:
                run = saved_values(meta.get("run") or {})   # in sections, or flat (older)
                row.update(mesh=meta.get("mesh"), strategy=meta.get("strategy"),
                           model=meta.get("model", {}).get("name"),
                           num_layers=meta.get("model", {}).get("num_layers"),
                           data=run.get("data"), batch_size=run.get("batch_size"),
                           seq_len=run.get("seq_len"), data_position=meta.get("data_position"),
                           lora=_lora(meta.get("model", {}).get("lora")))
            if verify:
                problem = row.get("error") or ckpt.verify(step)
                row["intact"] = problem is None
                if problem:
                    row["error"] = problem
            rows.append(row)
    partial = [n for n in os.listdir(directory) if "tmp" in n]
    if partial:
        rows.append({"partial": sorted(partial)})
    aside = [n for n in os.listdir(directory) if n.split(".")[0].isdigit() and "." in n
             and "tmp" not in n]
    if aside:
        rows.append({"set_aside": sorted(aside)})
    return rows


def _lora(saved: Optional[dict]) -> Optional[str]:
    """The saved model's adapters in words (``LoraConfig.describe``), or None."""
    if not saved:
        return None
    from triax.models.config import LoraConfig
    return LoraConfig(**{**saved, "targets": tuple(saved["targets"])}).describe()


def run(args) -> int:
    rows = list_checkpoints(args.directory, verify=args.verify)
    status = 1 if any(r.get("intact") is False for r in rows) else 0
    if args.json:
        print(json.dumps(rows, indent=1))
        return status
    steps = [r for r in rows if "step" in r]
    if not steps:
        print(f"no committed checkpoints in {args.directory}")
    else:
        print(f"{'step':>7}  {'size':>10}  {'model':14} {'mesh':28} {'strategy':8} "
              f"{'batch×seq':10} data")
    for r in steps:
        size = human_bytes(r["bytes"])
        if "error" in r:
            print(f"{r['step']:>7}  {size:>10}  DAMAGED: {r['error']}")
            continue
        model = f"{r['model']}/L{r['num_layers']}"
        print(f"{r['step']:>7}  {size:>10}  {model:14} {r['mesh']:28} {r['strategy']:8} "
              f"{str(r['batch_size']) + '×' + str(r['seq_len']):10} {r['data']}"
              + (f"  {r['lora']}" if r.get("lora") else "")
              + ("  intact" if r.get("intact") else ""))
    for r in rows:
        if "partial" in r:
            print(f"ignored partial saves: {', '.join(r['partial'])}")
        if "set_aside" in r:
            print(f"set aside (not resumed from, never deleted): {', '.join(r['set_aside'])}")
    if args.verify:
        print("every step is intact" if not status else "damaged steps found (see above); "
              "triax train --resume falls back to the newest intact step")
    return status
