"""The ``triax`` command line: a thin layer that parses arguments and calls the public API.

Each subcommand lives in its own module ``triax.cli.<name>`` exposing ``add_parser(sub)``
(registering itself on the argparse subparsers) and setting ``func`` to its runner.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("train", "inspect", "schedule", "plan", "generate", "serve", "plot", "checkpoints",
            "export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triax", description="One model, many devices: sharded training, inference and "
                                  "planning on a data × tensor × pipe (× expert) mesh.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"triax.cli.{name}_cmd").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        # User errors: one clear line, no traceback. Bugs still raise other exceptions.
        print(f"triax {args.command}: error: {advised(e)}", file=sys.stderr)
        return 2


def advised(e: Exception) -> Exception:
    """A predicted out-of-memory says what the planner would run instead: the check sits
    below the planner, so the suggestion is asked for here (``planner.memory_advice``)."""
    from triax.costs.fits import OutOfMemoryPredicted   # no JAX
    if not isinstance(e, OutOfMemoryPredicted):
        return e
    from triax.planner.memory_advice import advise
    return advise(e)


if __name__ == "__main__":
    raise SystemExit(main())
