"""Host offload of the train state: parameters and/or optimizer state kept in the host's
pinned memory between steps (``--offload optimizer|params|optimizer,params``).

Their shardings keep the mesh layout and gain ``memory_kind="pinned_host"``; the compiled
step takes them as host arguments (memory space ``S(5)`` in its entry layout), so they
leave the device's resident bytes. Within the step:

- offloaded parameters are copied to the device for the forward and backward, and the new
  ones written back to the host at the end;
- offloaded optimizer state is updated one of two ways (``Offload.update``):
  ``stream`` copies the moments to the device, updates there and writes them back (the
  link carries the state twice a step); ``host`` runs the optimizer update on the host
  with ``compute_on("device_host")`` (the link carries the gradients down and the new
  parameters up; the host's memory bandwidth does the update). ``costs.offload`` prices
  both and ``training.setup`` takes the cheaper.

    >>> Offload(("optimizer",)).optimizer, Offload(("optimizer",)).params
    (True, False)
    >>> Offload(("opt",))
    Traceback (most recent call last):
    ...
    ValueError: --offload 'opt': 'opt' is not a state part; give a comma-separated subset of optimizer, params, e.g. --offload optimizer
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.experimental.compute_on import compute_on

from triax.choices import OFFLOAD_UPDATES, check, parse_offload

HOST = "pinned_host"
DEVICE = "device"
PyTree = Any


@dataclass(frozen=True)
class Offload:
    """Which state parts live on the host (``targets``) and where the optimizer update
    runs when the optimizer state does (``update``: stream | host)."""

    targets: tuple[str, ...] = ()
    update: str = "stream"

    def __post_init__(self):
        object.__setattr__(self, "targets", parse_offload(",".join(self.targets)))
        check("offload_update", self.update, OFFLOAD_UPDATES)

    @property
    def params(self) -> bool:
        """The parameters live on the host between steps."""
        return "params" in self.targets

    @property
    def optimizer(self) -> bool:
        """The optimizer state lives on the host between steps."""
        return "optimizer" in self.targets

    @property
    def host_update(self) -> bool:
        """The optimizer update runs on the host (``compute_on``)."""
        return self.optimizer and self.update == "host"


def in_memory(shardings: PyTree, kind: str) -> PyTree:
    """``shardings`` with their memory kind set to ``kind`` (the layout unchanged)."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def moved(tree: PyTree, shardings: PyTree, kind: str) -> PyTree:
    """``tree`` copied into ``kind`` memory, laid out as ``shardings`` (traced: in a jit)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind(kind)),
                        tree, shardings)


def host_update(parts: tuple, grads, opt_state, params, ok,
                shardings: tuple[PyTree, PyTree]) -> tuple[PyTree, PyTree]:
    """``(new params, new opt_state)`` with the optimizer's elementwise link run on the host.

    ``parts``: the chained optimizer's links (``training.optim.optimizer_parts``); the first
    (clipping: a global norm over the device's gradients) runs on the device, the second
    (AdamW) on the host, where its state is. Gradients and parameters (laid out as
    ``shardings``: grads', params') are copied to the host; both results stay there. ``ok``
    (a scalar bool, or None) keeps the old parameters and state where False (a skipped
    non-finite step)."""
    clip, inner = parts
    grads, clip_state = clip.update(grads, opt_state[0], params)
    grad_sh, param_sh = shardings
    grads, params = moved(grads, grad_sh, HOST), moved(params, param_sh, HOST)
    ok = None if ok is None else jax.device_put(ok, jax.memory.Space.Host)

    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def update(grads, inner_state, params, ok):
        return device_update(inner, grads, inner_state, params, ok)
    new_params, inner_state = update(grads, opt_state[1], params, ok)
    return new_params, (clip_state, inner_state)


def device_update(tx, grads, opt_state, params, ok) -> tuple[PyTree, PyTree]:
    """``tx``'s update where its inputs are (the state streamed to the device already, or
    inside ``host_update``'s host computation)."""
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if ok is not None:
        new_params, new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o),
                                             (new_params, new_state), (params, opt_state))
    return new_params, new_state

