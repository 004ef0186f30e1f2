"""Mesh construction: named axes, topology order, hybrid meshes, simulated devices."""
from triax.mesh.build import (AXES, describe, make_hybrid_mesh, make_mesh, mesh_sizes, parse_mesh,
                              resolve_sizes)
from triax.mesh.simulate import simulate_cpu_devices

__all__ = ["AXES", "describe", "make_hybrid_mesh", "make_mesh", "mesh_sizes", "parse_mesh",
           "resolve_sizes", "simulate_cpu_devices"]
