"""Compiled pieces of a run — trainer, step, eval loss, initializer — reused when a later run
in the same process builds the same program (a resume after a stop, notebooks, tests, benches).

The key is the trainer's constructor arguments plus the batch shape: exactly what changes the
compiled program (all are hashable). The seed only picks an init.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> args = dict(model=config.get("tiny", num_layers=1), mesh=make_mesh(data=8), strategy="dp")
    >>> c = compiled_for(args, batch_size=8, seq_len=16)
    >>> c is compiled_for(dict(args), batch_size=8, seq_len=16)
    True
    >>> state = c.init(seed=0)
    >>> state, metrics = c.step(state, c.trainer.shard_batch(c.trainer.example_batch(8, 16)))
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
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
    batch_keys: tuple = ("inputs", "targets")   # the batch dict's keys (step.BATCH_DTYPES)
    _step: Any = None
    _eval: Any = None

    @property
    def is_step_compiled(self) -> bool:
        return self._step is not None

    @property
    def step(self) -> Callable:
        """The AOT-compiled step ``(state, batch) -> (state, metrics)`` (donates ``state``)."""
        if self._step is None:
            self._step = self.trainer.lower(self.batch_size, self.seq_len,
                                             self.batch_keys).compile()
        return self._step

    @property
    def eval_loss(self) -> Callable:
        if self._eval is None:
            tr, loss = self.trainer, self.trainer.loss_fn()

            def f(params, batch):
                params = tr.device_params(params)
                with activation_sharding(tr.mesh, tr.strategy):
                    # The model's own form: uneven stages store theirs stage by stage.
                    return loss(tr.to_model(params), batch)[0]
            self._eval = jax.jit(f, in_shardings=(tr.state_shardings["params"],
                                                  tr.batch_sharding()))
        return self._eval

    def init(self, seed: int):
        return self.trainer.init(seed)   # one compile for every seed (the seed is an argument)


def compiled_for(trainer_args: dict, batch_size: int, seq_len: int,
                 batch_keys: tuple = ("inputs", "targets")) -> Compiled:
    """The cached ``Compiled`` for ``Trainer(**trainer_args)`` at this batch shape (and
    batch keys), building the trainer on a miss."""
    key = (tuple(sorted(trainer_args.items())), batch_size, seq_len, tuple(batch_keys))
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    entry = Compiled(Trainer(**trainer_args), batch_size, seq_len, tuple(batch_keys))
    _CACHE[key] = entry
    while len(_CACHE) > _MAX_ENTRIES:
        _CACHE.popitem(last=False)
    return entry
