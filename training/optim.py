"""Optimizer: AdamW with global-norm clipping and a warmup + cosine learning-rate schedule.

The schedule depends only on these numbers (not on wall time or restarts), so a run that is
cut short and resumed follows exactly the same curve.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import optax


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, cosine decay to ``min_lr_ratio * lr``, and global-norm
    clipping; zero warm-up or decay steps are derived from the run length by ``resolved``."""

    lr: float = 3e-3
    warmup_steps: int = 0       # 0: derive from total steps (see resolved)
    decay_steps: int = 0        # 0: derive from total steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0

    def replace(self, **kw) -> "OptimConfig":
        """A copy with the given fields changed."""
        return dataclasses.replace(self, **kw)

    def resolved(self, total_steps: int) -> "OptimConfig":
        """Fill derived defaults: warmup = 10% of steps (≥1), decay over all steps."""
        total = max(int(total_steps), 1)
        return self.replace(
            warmup_steps=self.warmup_steps or max(1, total // 10),
            decay_steps=self.decay_steps or total)


def lr_schedule(oc: OptimConfig) -> optax.Schedule:
    warm = max(oc.warmup_steps, 1)
    decay = max(oc.decay_steps, warm + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=oc.lr, warmup_steps=warm, decay_steps=decay,
        end_value=oc.lr * oc.min_lr_ratio)


def optimizer_parts(oc: OptimConfig) -> tuple[optax.GradientTransformation, ...]:
    """The optimizer's links: clipping (a global norm: runs where the gradients are) and
    AdamW (elementwise: may run on the host, ``training.offload``); the chained state is the
    tuple of theirs, in this order."""
    return (optax.clip_by_global_norm(oc.clip_norm),
            optax.adamw(lr_schedule(oc), b1=oc.b1, b2=oc.b2, eps=oc.eps,
                        weight_decay=oc.weight_decay, mask=_decay_mask))


def make_optimizer(oc: OptimConfig) -> optax.GradientTransformation:
    return optax.chain(*optimizer_parts(oc))


def _decay_mask(params):
    # No weight decay on norm scales (1-D per layer) — the usual Llama recipe.
    return jax.tree_util.tree_map_with_path(
        lambda path, p: not any(getattr(k, "key", None) == "scale" for k in path), params)
