"""Where the weights come from: a training checkpoint, or a seeded random init.

Checkpoints use the one layout of ``triax.checkpoint``; only ``state/params`` is read (Orbax
partial restore), straight onto the serving mesh's shardings, so no device ever holds the
whole model unless the layout says so.

    >>> from triax.mesh import make_mesh
    >>> mesh = make_mesh(tensor=2, devices=jax.devices()[:2])
    >>> cfg, params = load_params(mesh, checkpoint="runs/tiny")          # doctest: +SKIP
    >>> cfg, params = load_params(mesh, model="tiny", seed=0)
"""
from __future__ import annotations

from typing import Any, Optional

import jax
from jax.sharding import Mesh

from triax.checkpoint import (CheckpointError, Checkpointer, check_same_model, model_from_meta)
from triax.checkpoint.layout import first_line, params_meta
from triax.models import config as model_config
from triax.models.config import ModelConfig
from triax.sharding.partition import abstract_model, init_params, param_shardings
from triax.choices import SERVE_STRATEGY

# The inference API's name for checkpoint errors (one class: triax.checkpoint's).
CheckpointLoadError = CheckpointError


def read_checkpoint_config(directory: str, step: Optional[int] = None) -> tuple[ModelConfig, int]:
    with Checkpointer.existing(directory) as ckpt:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no committed checkpoint step in {directory!r}")
        meta = ckpt.read_meta(step)
    return model_from_meta(meta, f"checkpoint step {step} in {directory!r}"), step


def load_params(mesh: Mesh, checkpoint: Optional[str] = None, model: Optional[str] = None,
                seed: int = 0, strategy=SERVE_STRATEGY, step: Optional[int] = None,
                num_layers: Optional[int] = None) -> tuple[ModelConfig, Any]:
    """The one entry point for weights: ``(cfg, params sharded on mesh)``.

    With ``checkpoint``, the config comes from the checkpoint (``model``, if given, must
    match it); otherwise ``model`` (a preset name) is initialised from ``seed``.
    """
    wanted = model_config.get(model, num_layers) if model else None
    if checkpoint is None:
        if wanted is None:
            raise CheckpointError("give --checkpoint DIR or --model NAME (with --seed)")
        return wanted, init_params(abstract_model(wanted), mesh, strategy, seed)
    cfg, step = read_checkpoint_config(checkpoint, step)
    if wanted is not None:
        check_same_model(cfg, wanted, where=f"checkpoint {checkpoint!r}",
                         fix="drop --model to use the checkpoint's own config, or pass the "
                             "matching one")
    am = abstract_model(cfg)
    shardings = param_shardings(am, mesh, strategy)
    target = {"params": jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                          sharding=sh),
                                     am.shapes, shardings)}
    try:
        with Checkpointer.existing(checkpoint) as ckpt:
            state = ckpt.restore_part(step, target)
    except Exception as e:  # orbax raises many types; name the checkpoint and the cause
        raise CheckpointError(f"cannot restore params from checkpoint step {step} in "
                              f"{checkpoint!r} ({type(e).__name__}: {first_line(e)})") from None
    return cfg, state["params"]


def save_params(directory: str, step: int, cfg: ModelConfig, params: Any) -> None:
    """Write params in the training layout (``state/params`` + ``meta/model``), e.g. to serve
    an exported or converted model; training writes the same layout with optimizer state."""
    ckpt = Checkpointer(directory, keep=None, async_save=False)
    ckpt.save(step, {"params": params}, params_meta(cfg), wait=True)
    ckpt.close()
