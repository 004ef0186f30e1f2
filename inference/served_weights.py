"""The weights as an engine serves them: their floating leaves in the served dtype
(``--dtype``; ``EngineConfig.dtype``), the others (int8 projections, a bf16 base) as they
are (``models.quantize.served_dtype``, the rule the engine, the memory check, the planner
and the no-cache reference share); under ``--quantize int8`` (``EngineConfig.quantize``)
the block projections quantized where they are placed (``models.quantize``).

    >>> import jax.numpy as jnp
    >>> served_dtype(jnp.float32, "bfloat16"), served_dtype(jnp.int8, "bfloat16")
    (dtype(bfloat16), dtype('int8'))
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from triax.costs.param_layout import local_served_bytes
from triax.costs.workload import Layout, Workload
from triax.mesh.build import mesh_sizes
from triax.models.quantize import cast_like, served_dtype  # noqa: F401 (served_dtype: re-exported)
from triax.pipeline import ScheduleKind
from triax.sharding.partition import abstract_model, param_shardings
from triax.sharding.rules import get_strategy
from triax.units import human_bytes


def cast_params(params, dtype: str, shardings):
    """``params`` with their fp32 leaves cast to ``dtype``, placed on ``shardings``."""
    if all(x.dtype == served_dtype(x.dtype, dtype) for x in jax.tree.leaves(params)):
        return params   # (loaded in the served dtype already: no copy)
    # no donation: the caller's arrays may be these very ones (a device_put in place)
    return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(served_dtype(x.dtype, dtype)), p),
                   out_shardings=shardings)(params)


def place_params(params, given_cfg, am, mesh, strategy, dtype: str, shardings):
    """``params`` (``given_cfg``'s tree, anywhere) as served on ``mesh``: on ``shardings``
    (``am``'s, the served model's) in the served dtypes. When ``am`` quantizes what
    ``given_cfg`` does not, each projection is quantized on ``mesh`` from its placed shards
    (the scale's max over split input dims reduced across them: the one-device values)."""
    if am.cfg == given_cfg:
        return cast_params(jax.device_put(params, shardings), dtype, shardings)
    placed = jax.device_put(params, param_shardings(abstract_model(given_cfg), mesh, strategy))
    return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(served_dtype(x.dtype, dtype)),
                                          cast_like(p, am.shapes)),
                   out_shardings=shardings)(placed)   # no donation: maybe the caller's


def bytes_per_device(params) -> int:
    """The placed ``params``' bytes on the device holding the most (read from the arrays'
    shards, as allocated)."""
    held: dict = {}
    for x in jax.tree.leaves(params):
        for s in x.addressable_shards:
            held[s.device] = held.get(s.device, 0) + s.data.nbytes
    return max(held.values(), default=0)


def planned_bytes_per_device(cfg, mesh, strategy, ecfg) -> int:
    """The planner's figure for the weights an engine of ``ecfg`` places per device
    (``costs.param_layout.local_served_bytes`` on the served model, ``Workload.of_engine``)."""
    sizes = {a: mesh_sizes(mesh).get(a, 1) for a in ("tensor", "pipe", "data", "context",
                                                      "expert")}
    p = sizes["pipe"]
    lay = Layout(**sizes, strategy=get_strategy(strategy).name,
                 schedule=ScheduleKind.FORWARD_ONLY if p > 1 else None, microbatches=p)
    return local_served_bytes(Workload.of_engine(cfg, ecfg), lay)


def describe_weights(engines) -> str:
    """The served weights in a phrase (the ready line, ``Server.describe``): their dtype,
    quantization, and bytes per device placed and planned (the largest replica's)."""
    e = engines[0]
    placed = max(bytes_per_device(x.params) for x in engines)
    planned = max(planned_bytes_per_device(x.cfg, x.mesh, x.strategy, x.ecfg) for x in engines)
    kind = f"{e.ecfg.dtype} weights" + (f" with {e.ecfg.quantize} projections"
                                        if e.ecfg.quantize != "none" else "")
    return (f"{kind} ({human_bytes(placed)} per device; planned {human_bytes(planned)})")
