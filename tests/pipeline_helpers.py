"""Shared by the pipeline tests: the single-device run a pipelined one must equal."""
import jax
import numpy as np

from triax.mesh import make_mesh
from triax.models import config
from triax.training.step import Trainer


def single_device_references(B: int, T: int, masked: bool = False):
    """``get(L)`` -> ``(cfg, host params, batch, loss, grads)`` of tiny with ``L`` layers on one
    device, computed once per ``L``. ``masked``: every fifth token's loss weight is 0.
    ``get.init_state(L)``: the whole host train state those params came from (for a run
    that places it instead of compiling an init of its own)."""
    cache, states = {}, {}

    def get(L):
        if L not in cache:
            cfg = config.TINY.replace(num_layers=L)
            ref = Trainer(cfg, make_mesh(devices=jax.devices()[:1]), "dp")
            states[L] = jax.device_get(ref.init(0))
            params = states[L]["params"]
            batch = ref.example_batch(B, T)
            if masked:
                batch["weights"] = (np.arange(B * T).reshape(B, T) % 5 != 0).astype(np.float32)
            (loss, _), grads = ref.grads(params, batch)
            cache[L] = (cfg, params, batch, float(loss), jax.device_get(grads))
        return cache[L]

    def init_state(L):
        get(L)
        return states[L]
    get.init_state = init_state
    return get
