"""Shared by the LoRA tests: a start with non-zero B and a few compiled steps on one layout,
with the first step's adapter gradients read from Adam's first moment."""
import jax
import numpy as np
from step_grads import first_step_grads

from triax.models import lora
from triax.training.step import Trainer


def start_state(trainer):
    """The trainer's init (host arrays) with every B made non-zero (B = 0 would zero A's
    gradients). Its optimizer state is the fresh one of any layout of the same model and
    optimizer, so ``run_steps`` places it (``Trainer.place``): no program per layout to
    build a fresh state."""
    state = jax.device_get(trainer.init(0))
    ad, base = lora.split(state["params"])
    rng = np.random.default_rng(1)
    ad = jax.tree_util.tree_map_with_path(
        lambda p, x: (0.05 * rng.standard_normal(x.shape)).astype(x.dtype)
        if p[-1].key == "b" else x, ad)
    return {**state, "params": lora.join(ad, base)}


def run_steps(cfg, mesh, strategy, pipeline, start, B, T, steps=3):
    """``steps`` compiled steps from the host train state ``start`` (``start_state``) on
    batches of seeds 0, 1, …: the losses, the first step's gradients
    (``step_grads.first_step_grads``), the final params and optimizer state, the compiled
    step and its trainer."""
    tr = Trainer(cfg, mesh, strategy, pipeline=pipeline)
    compiled = tr.lower(B, T).compile()
    state = tr.place(start)   # the model's form in (uneven stages: restacked), a transfer
    losses = []
    for i in range(steps):
        state, m = compiled(state, tr.shard_batch(tr.example_batch(B, T, seed=i)))
        losses.append(float(m["loss"]))
        if i == 0:
            grads = first_step_grads(tr, state, m)
    return dict(loss=losses[0], grads=grads, losses=losses, compiled=compiled, trainer=tr,
                params=tr.to_model(jax.device_get(state["params"])),
                opt=jax.device_get(state["opt_state"]))
