"""Shared by the LoRA tests: a start with non-zero B and a few compiled steps on one layout,
with the first step's adapter gradients read from Adam's first moment."""
import jax
import numpy as np
from step_grads import first_step_grads

from triax.models import lora
from triax.training.step import Trainer


def start_state(trainer, from_init=True):
    """The trainer's init (host arrays) with every B made non-zero (B = 0 would zero A's
    gradients). Its optimizer state is the fresh one of any layout of the same model and
    optimizer, so ``run_steps`` places it (``Trainer.place``): no program per layout to
    build a fresh state.

    ``from_init=False``: where any start serves (a comparison of layouts from one start), the
    parameters are drawn on the host at the init's scales (fp32 weights N(0, 0.02), norm
    scales 1, A N(0, 0.07)) around a fresh optimizer state, all zeros as AdamW's and the
    schedule's init make it: no init program to compile (~40 % of a tiny dp step's)."""
    state = jax.device_get(trainer.init(0)) if from_init else _host_state(trainer)
    ad, base = lora.split(state["params"])
    rng = np.random.default_rng(1)
    ad = jax.tree_util.tree_map_with_path(
        lambda p, x: (0.05 * rng.standard_normal(x.shape)).astype(x.dtype)
        if p[-1].key == "b" else x, ad)
    return {**state, "params": lora.join(ad, base)}


def _host_state(trainer):
    rng = np.random.default_rng(0)

    def draw(path, x):
        assert x.dtype == np.float32, (jax.tree_util.keystr(path), x.dtype)   # an fp32 base
        key = path[-1].key
        if key == "scale":
            return np.ones(x.shape, x.dtype)
        return ((0.07 if key == "a" else 0.02) * rng.standard_normal(x.shape)).astype(x.dtype)
    abstract = trainer.abstract_state()
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract)
    return {**zeros, "params": jax.tree_util.tree_map_with_path(draw, abstract["params"])}


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
