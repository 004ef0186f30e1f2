"""The train state's form against the model's: under uneven pipeline stages the blocks are
stored stage by stage (``Pipeline.stored``, ``StageLayers.store``: ``[S·Lc, ...]``, split
over ``pipe``), while checkpoints and equality checks see the model's own ``[L, ...]``.
:class:`StoredForm` is the ``Trainer``'s half that converts between them; without uneven
stages both forms are one and every conversion is the identity.
"""
from __future__ import annotations

from functools import cached_property
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from triax.sharding.partition import param_shardings

PyTree = Any


class StoredForm:
    """Mixed into ``training.step.Trainer``: needs its ``pipeline``, ``abstract``,
    ``stored``, ``mesh``, ``tx``, ``trainable``, ``param_shardings``, ``state_shardings``
    and ``_init_fn``. :meth:`place` puts a saved-form state made elsewhere onto the mesh."""

    def to_stored(self, params: PyTree) -> PyTree:
        """The model's parameters (or gradients, or their trainable part) → the train
        state's form (``Pipeline.store``; unchanged unless uneven stages restack the blocks)."""
        return params if self.pipeline is None else self.pipeline.store(params)

    def to_model(self, params: PyTree) -> PyTree:
        """Inverse of :meth:`to_stored`: the model's own ``[L, ...]`` form."""
        return params if self.pipeline is None else self.pipeline.unstore(params)

    @property
    def restacked(self) -> bool:
        """Whether the train state's form differs from the model's (uneven stages)."""
        return self.stored is not self.abstract

    @property
    def model_strategy(self):
        """The strategy of the model's own form (``Pipeline.model_strategy``)."""
        return self.strategy if self.pipeline is None else self.pipeline.model_strategy

    @cached_property
    def model_param_shardings(self) -> PyTree:
        """Shardings of the model's own form (``Pipeline.model_strategy``)."""
        if not self.restacked:
            return self.param_shardings
        return param_shardings(self.abstract, self.mesh, self.pipeline.model_strategy)

    def _state_map(self, state: PyTree, params_fn: Callable, blocks_fn: Callable) -> PyTree:
        """A train state with ``params_fn`` over its parameters and ``blocks_fn`` over the
        blocks' leaves of every parameter-shaped part of the optimizer state (Adam's moments)."""
        keep = lambda a: a  # noqa: E731
        conv = {k: jax.tree.map(lambda _: blocks_fn if k == "blocks" else keep, v)
                for k, v in self.trainable(self.abstract.shapes).items()}
        opt = optax.tree_map_params(self.tx, lambda p, f: f(p), state["opt_state"], conv,
                                    transform_non_params=keep)
        return {**state, "params": params_fn(state["params"]), "opt_state": opt}

    def saved_form(self, state: PyTree) -> PyTree:
        """The train state as checkpoints hold it, whatever the stages: the model's own
        ``[L, ...]`` blocks (traced: jit it with ``out_shardings=saved_shardings``)."""
        if not self.restacked:
            return state
        return self._state_map(state, self.to_model, self.pipeline.layout.unstore)

    def from_saved(self, state: PyTree) -> PyTree:
        """Inverse of :meth:`saved_form`: a checkpoint's state in this run's stored form."""
        if not self.restacked:
            return state
        return self._state_map(state, self.to_stored, self.pipeline.layout.store)

    @cached_property
    def saved_shardings(self) -> PyTree:
        """Shardings of :meth:`saved_form`'s state (the model's form's strategy)."""
        if not self.restacked:
            return self.state_shardings
        grads = self.trainable(param_shardings(self.abstract, self.mesh,
                                               self.pipeline.model_strategy, optimizer=True))
        abstract_opt = jax.eval_shape(self.tx.init, self.trainable(self.abstract.shapes))
        replicated = NamedSharding(self.mesh, P())
        opt = optax.tree_map_params(self.tx, lambda _, s: s, abstract_opt, grads,
                                    transform_non_params=lambda _: replicated)
        return {"params": self.model_param_shardings, "opt_state": opt, "step": replicated}

    def saved_abstract_state(self) -> PyTree:
        """The Orbax restore target: :meth:`abstract_state` in :meth:`saved_form`."""
        shapes = jax.eval_shape(lambda: self.saved_form(self._init_fn(0)()))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.saved_shardings)

    @cached_property
    def to_saved(self) -> Callable:
        """Jitted :meth:`saved_form` (what the loop saves; the identity when not restacked)."""
        if not self.restacked:
            return lambda state: state
        return jax.jit(self.saved_form, out_shardings=self.saved_shardings)

    @cached_property
    def restored(self) -> Callable:
        """Jitted :meth:`from_saved` (a restored checkpoint's state → this run's)."""
        if not self.restacked:
            return lambda state: state
        return jax.jit(self.from_saved, out_shardings=self.state_shardings)

    def place(self, state: PyTree) -> PyTree:
        """A train state made elsewhere, put where this trainer keeps it: a transfer, with no
        init program to compile for this mesh (uneven stages: one restacking program).

        ``state`` is in the saved form (:meth:`saved_abstract_state`: the model's own
        ``[L, ...]`` blocks, as checkpoints hold it): host arrays (``jax.device_get``) or
        another placement's, e.g. a one-device Trainer's of the same model and optimizer, whose
        ``init`` is this one's bit for bit (the random numbers do not depend on the split).
        Arrays already placed as here are taken as they are, and :meth:`step` donates them:
        pass host arrays to keep yours.
        """
        want = dict(_leaves(self.saved_abstract_state()))
        got = dict(_leaves(state))
        if got.keys() != want.keys():
            lacks, extra = want.keys() - got.keys(), got.keys() - want.keys()
            differ = ([f"lacks {_some(lacks)}"] if lacks else []) + \
                ([f"has {_some(extra)}, which this trainer does not"] if extra else [])
            raise ValueError(f"Trainer.place: the state {' and '.join(differ)}; give a train "
                             f"state of the same model, optimizer and LoRA settings, in the "
                             f"saved form (Trainer.saved_abstract_state)")
        for path, w in want.items():
            shape, dtype = jnp.shape(got[path]), jnp.result_type(got[path])
            if (shape, dtype) != (w.shape, w.dtype):
                raise ValueError(f"Trainer.place: {path} is {dtype}{list(shape)}, this "
                                 f"trainer holds {w.dtype}{list(w.shape)}; give a train "
                                 f"state of the same model and optimizer")
        return self.restored(jax.device_put(state, self.saved_shardings))


def _leaves(tree: PyTree) -> list:
    """``(key path, leaf)`` of every leaf, the path as text (``['params']['embed']``)."""
    return [(jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _some(keys, n: int = 3) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:n]) + (f" (and {len(keys) - n} more)" if len(keys) > n else "")
