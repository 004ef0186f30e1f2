"""``triax train``: sharded training runs with checkpoints, resume and metrics.

    triax train                                   # tiny on pydoc text, 8 simulated devices
    triax train --model tiny --mesh data=2,tensor=2,pipe=2 --strategy fsdp_tp \\
        --steps 100 --seed 0 --batch-size 16 --seq-len 128 --log-json run.jsonl \\
        --checkpoint-dir ckpt --checkpoint-every 50
    triax train --config run.toml --steps 300 --resume     # flags override the file
    triax train --plan auto --device-memory 64MiB --dry-run  # choose the layout, print it
    triax train --plan auto --strategy fsdp --steps 100      # fsdp fixed, the rest searched

Every ``RunConfig`` field is a flag (``triax.cli.run_flags``).
"""
from __future__ import annotations

import argparse
import json
import sys

from triax.cli.flags import add_json
from triax.cli.common import start_devices
from triax.cli.run_flags import add_run_flags, run_values
from triax.training.config import RunConfig, RunConfigWarning, load_config_file
from triax.configs import warn_inert
from triax.training.inert import inert_flags

# Nothing here imports JAX at module level: the device count must be set before it loads.


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model on a mesh (checkpoints, resume, metrics)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML or YAML file with the same keys; flags override it")
    add_run_flags(p)
    # How the command reports, not part of the run: so not RunConfig's.
    p.add_argument("--dry-run", action="store_true",
                   help="with --plan auto: print the choice and stop (nothing is allocated)")
    add_json(p, "with --plan auto: print the choice as one JSON object")
    g = p.add_argument_group("multi-process (default: auto-detect SLURM, Open MPI, Kubernetes)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int)
    g.add_argument("--process-id", type=int)
    g.add_argument("--heartbeat-timeout", type=int, metavar="SECONDS",
                   help="a process silent this long is dead: the others exit non-zero naming "
                        "it (default: JAX's, 100)")
    p.set_defaults(func=run)


def run_config_and_given(args) -> tuple[RunConfig, frozenset]:
    """The run (RunConfig defaults < ``--config`` file < explicit flags), and the fields the
    user gave (explicit flags and ``--config`` keys): what ``--plan auto`` keeps fixed."""
    values = load_config_file(args.config) if args.config else {}
    values.update(run_values(args))
    if values.get("init_from") and "model" in values:
        raise ValueError(f"--model {values['model']!r} conflicts with --init-from "
                         f"{values['init_from']!r}: the model comes from its config.json; "
                         f"drop --model")
    run = RunConfig(**values)
    warn_inert(inert_flags(run, values), RunConfigWarning)
    return run, frozenset(values)


def run(args) -> int:
    start_devices()  # before JAX starts its backend
    run_cfg, given = run_config_and_given(args)
    if (args.dry_run or args.json) and run_cfg.plan != "auto":
        raise ValueError("--dry-run and --json report --plan auto's choice; add --plan auto")
    # Loaded only now: these modules start JAX.
    from triax.training import distributed
    from triax.training.loop import Interrupted, train
    from triax.training.run_summary import format_summary
    how = distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                 args.heartbeat_timeout)
    main = distributed.is_main_process()
    if main and how != "single process":
        print(f"triax train: multi-process ({how})", file=sys.stderr)
    if run_cfg.plan == "auto":
        from triax.planner.auto import choose_train
        from triax.planner.auto_mixed import choose_mixed
        choice = (choose_mixed if run_cfg.plan_gpu else choose_train)(run_cfg, given)
        if main:
            print(json.dumps(choice.to_json(), indent=2) if args.json else choice.describe(),
                  file=sys.stdout if args.dry_run or args.json else sys.stderr)
        if args.dry_run:
            return 0
        run_cfg = choice.run
    try:
        result = train(run_cfg, note=lambda m: print(m, file=sys.stderr))
    except Interrupted as e:
        if main:
            print(f"triax train: {e}", file=sys.stderr)
        return 128 + e.signum
    if main:
        print(format_summary(result.summary))
    return 0
