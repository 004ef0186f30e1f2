"""A user's own Flax NNX model, as ``Trainer.for_model`` holds it: how to build it, its loss,
and the rules for its own logical names — hashable, so compiled steps can be cached on it.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> class Affine(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.w = nnx.Param(jnp.ones((4, 8)), out_sharding=("embed", "hidden"))
    >>> def loss(model, batch):
    ...     return jnp.mean((batch["x"] @ model.w[...]) ** 2), {}
    >>> m = UserModel.of(Affine, loss, rules={"hidden": "tensor"})
    >>> m.rules
    (('hidden', 'tensor'),)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from flax import nnx

from triax.models.lora import freeze_base
from triax.models.protocol import missing_protocol, stack_loss
from triax.sharding.partition import AbstractModel, abstract_module


def _freeze(value):
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class UserModel:
    """``make_model(rngs) -> nnx.Module`` (its params carry logical names) and
    ``loss_fn(model, batch) -> (loss, aux dict)``; ``rules`` add to the strategy preset."""

    make_model: Callable[[nnx.Rngs], nnx.Module]
    loss_fn: Callable[[nnx.Module, dict], tuple]
    rules: tuple = ()                 # ((logical name, mesh axes | known name | None), ...)
    default: Optional[str] = None     # "replicate": parameters without names are replicated

    @classmethod
    def of(cls, make_model, loss_fn=None, rules: Optional[Mapping[str, Any]] = None,
           default: Optional[str] = None) -> "UserModel":
        """``loss_fn=None``: the model's pipeline protocol defines the loss
        (``head_loss`` of the stacked forward ÷ ``loss_weight``; see ``stack_loss``)."""
        loss_fn = stack_loss if loss_fn is None else loss_fn
        if not callable(make_model) or not callable(loss_fn):
            raise TypeError("Trainer.for_model(make_model, loss_fn, ...): both must be callables "
                            "(rngs -> nnx.Module, and (model, batch) -> (loss, aux))")
        return cls(make_model, loss_fn,
                   tuple(sorted((k, _freeze(v)) for k, v in (rules or {}).items())), default)

    def abstract(self) -> AbstractModel:
        """The model described abstractly (``abstract_module``), checked against the protocol."""
        am = abstract_module(self.make_model, default=self.default)
        if self.loss_fn is stack_loss:
            with nnx.use_eager_sharding(False):
                missing = missing_protocol(nnx.eval_shape(lambda: self.make_model(nnx.Rngs(0))))
            if missing:
                raise TypeError(f"Trainer.for_model without loss_fn needs the model's pipeline "
                                f"protocol (embed, block, head_loss over 'blocks'); it lacks "
                                f"{missing}: pass loss_fn=(model, batch) -> (loss, aux)")
        return am


def user_loss(am: AbstractModel, loss_fn: Callable) -> Callable:
    """``loss(params, batch) -> (loss, aux)`` for a user's model (the train step's contract)."""
    def loss(params, batch):
        # With adapters the base is frozen: no weight-gradient work is traced for it.
        out = loss_fn(nnx.merge(am.graphdef, freeze_base(params)), batch)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise TypeError(f"loss_fn must return (loss, aux dict), got {type(out).__name__}; "
                            f"return (loss, {{}}) when there is nothing else to report")
        return out
    return loss
