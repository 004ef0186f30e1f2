"""A step's gradients read back from the optimizer they fed, so one compiled step gives the
loss, the gradients and the steps after (no second, gradient-only program to compile)."""
import jax
import numpy as np


def adam_mu(opt_state):
    """The first moment of the optimizer chain's Adam (``training.optim.make_optimizer``)."""
    return next(s.mu for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))
                if hasattr(s, "mu"))


def first_step_grads(trainer, state, metrics):
    """The gradients of the first step from a fresh optimizer, in the model's form and
    unclipped: Adam's first moment is then ``(1 - b1)·g·c`` with ``c`` the global-norm clip's
    ``min(1, clip_norm / grad_norm)`` (``grad_norm``: the step's own metric), so a gradient
    wrong by a uniform factor still shows."""
    oc = trainer.optim
    unclip = max(1.0, float(metrics["grad_norm"]) / oc.clip_norm)
    mu = trainer.to_model(jax.device_get(adam_mu(state["opt_state"])))
    return jax.tree.map(lambda m: np.asarray(m) / (1 - oc.b1) * unclip, mu)
