"""triax: one model, many devices.

A JAX/XLA SPMD framework: parameters and activations carry logical axis names, one rules
table maps them onto a ``data × tensor × pipe (× expert)`` mesh, and XLA inserts the
collectives. See README.md for the tour.

The public API is named here and loaded on first use, so ``import triax`` does not start JAX
(a command line must set the simulated device count first)::

    import triax
    mesh = triax.make_mesh(data=2, tensor=4)
    trainer = triax.Trainer.for_model(make_model, loss_fn, mesh, "fsdp_tp", rules={...})
    report = triax.inspect(trainer, batch)
    sched = triax.pipeline.build("1f1b", stages=4, microbatches=8)

These names (and ``triax.pipeline``, ``triax.models.config``, ``triax.mesh.make_hybrid_mesh``)
are the public API, documented in docs/api.md; every other module stays importable but may
change.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "make_mesh": "triax.mesh",
    "Trainer": "triax.training.step",
    "PipelineConfig": "triax.pipeline.pipelined",
    "OptimConfig": "triax.training.optim",
    "ExecConfig": "triax.models.runtime",
    "describe": "triax.mesh",
    "abstract_module": "triax.sharding.partition",
    "get_strategy": "triax.sharding.rules",
    "inspect": "triax.sharding.introspect.step_report",
    "verify": ("triax.planner.verify", "verify_trainer"),
    "auto_trainer": "triax.planner.auto_model",
    "plan": "triax.planner",
    "generate": ("triax.inference.generate", "generate"),
    "pipeline": ("triax.pipeline", None),        # the subpackage: triax.pipeline.build(...)
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        module, attr = _PUBLIC[name] if isinstance(_PUBLIC[name], tuple) else (_PUBLIC[name], name)
        value = importlib.import_module(module)
        value = value if attr is None else getattr(value, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'triax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
