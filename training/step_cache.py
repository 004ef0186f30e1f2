"""Compiled pieces of a run — trainer, step, eval loss, initializer — reused when a later run
in the same process has the same shape (a resume after a stop, notebooks, tests, benches).

The key holds everything that changes the compiled program; the seed only picks an init.

    >>> c = compiled_for(run, cfg, mesh, build_trainer)
    >>> state = c.init(run.seed); state, metrics = c.step(state, batch)
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import jax

from triax.sharding.partition import activation_sharding
from triax.training.step import Trainer

_CACHE: "OrderedDict[tuple, Compiled]" = OrderedDict()
_MAX_ENTRIES = 4


@dataclass
class Compiled:
    trainer: Trainer
    batch_size: int
    seq_len: int
    _step: Any = None
    _eval: Any = None
    _inits: dict = field(default_factory=dict)

    @property
    def is_step_compiled(self) -> bool:
        return self._step is not None

    @property
    def step(self) -> Callable:
        if self._step is None:
            self._step = self.trainer.lower(self.batch_size, self.seq_len).compile()
        return self._step

    @property
    def eval_loss(self) -> Callable:
        if self._eval is None:
            tr, loss = self.trainer, self.trainer.loss_fn()

            def f(params, batch):
                with activation_sharding(tr.mesh, tr.strategy):
                    return loss(params, batch)[0]
            self._eval = jax.jit(f, in_shardings=(tr.param_shardings, tr.batch_sharding()))
        return self._eval

    def init(self, seed: int):
        if seed not in self._inits:
            tr = self.trainer
            self._inits[seed] = jax.jit(tr._init_fn(seed), out_shardings=tr.state_shardings)
        return self._inits[seed]()


def compiled_for(run, cfg, mesh, build: Callable[..., Trainer]) -> Compiled:
    """The cached ``Compiled`` for this run's program, building the trainer on a miss."""
    key = (cfg, mesh, run.strategy, run.optim_config().resolved(run.steps), run.exec_config(),
           run.grad_accum, run.batch_size, run.seq_len, run.schedule, run.microbatches, run.virtual)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    entry = Compiled(build(run, cfg, mesh), run.batch_size, run.seq_len)
    _CACHE[key] = entry
    while len(_CACHE) > _MAX_ENTRIES:
        _CACHE.popitem(last=False)
    return entry
