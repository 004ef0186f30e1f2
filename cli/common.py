"""Argument groups shared by subcommands (model, mesh, strategy) and device start-up."""
from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser, default: str = "tiny") -> None:
    p.add_argument("--model", default=default, help="model preset (tiny, small, llama3-8b, ...)")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layers")


def add_mesh_args(p: argparse.ArgumentParser, default_mesh: str | None = None,
                  default_strategy: str = "fsdp_tp") -> None:
    p.add_argument("--mesh", default=default_mesh,
                   help="axis=size pairs, e.g. data=2,tensor=2,pipe=2 (axes left out are 1; "
                        "default: all devices on data)")
    p.add_argument("--strategy", default=default_strategy,
                   help="dp | fsdp | zero1 | tp | fsdp_tp")


def start_devices() -> None:
    """Simulate 8 CPU devices when no accelerator is present (must precede JAX start-up)."""
    from triax.mesh.simulate import simulate_cpu_devices
    simulate_cpu_devices()


def model_from_args(args):
    from triax.models import config
    return config.get(args.model, args.num_layers)


def mesh_from_args(args):
    from triax.mesh import make_mesh, parse_mesh
    sizes = parse_mesh(args.mesh) if args.mesh else {"data": -1}
    return make_mesh(**sizes)
