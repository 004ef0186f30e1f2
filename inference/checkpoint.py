"""Where the weights come from: a training checkpoint, or a seeded random init.

Checkpoint layout (the one ``triax.training.checkpoint.Checkpointer`` writes)::

    DIR/<step>/state   Orbax StandardSave of {"params": ..., "opt_state": ..., "step": ...}
    DIR/<step>/meta    JSON with "model": dataclasses.asdict(ModelConfig)

Only ``state/params`` is read (Orbax partial restore), straight onto the serving mesh's
shardings, so no device ever holds the whole model unless the layout says so.

    >>> cfg, params = load_params(mesh, checkpoint="runs/tiny")          # doctest: +SKIP
    >>> cfg, params = load_params(mesh, model="tiny", seed=0)
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from triax.models import config as model_config
from triax.models.config import ModelConfig, MoEConfig
from triax.sharding.partition import abstract_model, init_params, param_shardings

ITEMS = ("state", "meta")


class CheckpointLoadError(ValueError):
    """A checkpoint that cannot serve the requested model; the message says the fix."""


def config_from_json(d: dict) -> ModelConfig:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise CheckpointLoadError(f"checkpoint model config has unknown field(s) {unknown}; it "
                                  f"was written by another triax version")
    d = dict(d)
    if d.get("moe") is not None:
        d["moe"] = MoEConfig(**d["moe"])
    return ModelConfig(**d)


def config_json(cfg: ModelConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _manager(directory: str) -> ocp.CheckpointManager:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    return ocp.CheckpointManager(os.path.abspath(directory), item_names=ITEMS,
                                 options=ocp.CheckpointManagerOptions(read_only=True))


def read_checkpoint_config(directory: str, step: Optional[int] = None) -> tuple[ModelConfig, int]:
    mgr = _manager(directory)
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise CheckpointLoadError(f"no committed checkpoint step in {directory!r}")
    meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if "model" not in meta:
        raise CheckpointLoadError(f"checkpoint step {step} in {directory!r} has no model config "
                                  f"in its meta item")
    return config_from_json(meta["model"]), step


def check_config(saved: ModelConfig, wanted: ModelConfig, directory: str) -> None:
    a, b = config_json(saved), config_json(wanted)
    diff = [f"{k}: checkpoint {a.get(k)!r} vs requested {b.get(k)!r}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diff:
        raise CheckpointLoadError(f"checkpoint {directory!r} holds a different model ("
                                  f"{'; '.join(diff)}); drop --model to use the checkpoint's "
                                  f"own config, or pass the matching one")


def load_params(mesh: Mesh, checkpoint: Optional[str] = None, model: Optional[str] = None,
                seed: int = 0, strategy="tp", step: Optional[int] = None,
                num_layers: Optional[int] = None) -> tuple[ModelConfig, Any]:
    """The one entry point for weights: ``(cfg, params sharded on mesh)``.

    With ``checkpoint``, the config comes from the checkpoint (``model``, if given, must
    match it); otherwise ``model`` (a preset name) is initialised from ``seed``.
    """
    wanted = model_config.get(model, num_layers) if model else None
    if checkpoint is None:
        if wanted is None:
            raise CheckpointLoadError("give --checkpoint DIR or --model NAME (with --seed)")
        return wanted, init_params(abstract_model(wanted), mesh, strategy, seed)
    cfg, step = read_checkpoint_config(checkpoint, step)
    if wanted is not None:
        check_config(cfg, wanted, checkpoint)
    am = abstract_model(cfg)
    shardings = param_shardings(am, mesh, strategy)
    target = {"params": jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                                          sharding=sh),
                                     am.shapes, shardings)}
    try:
        out = _manager(checkpoint).restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True)))
    except Exception as e:  # orbax raises many types; name the checkpoint and the cause
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CheckpointLoadError(f"cannot restore params from checkpoint step {step} in "
                                  f"{checkpoint!r} ({type(e).__name__}: {first})") from None
    return cfg, out["state"]["params"]


def save_params(directory: str, step: int, cfg: ModelConfig, params: Any) -> None:
    """Write params in the training layout (``state/params`` + ``meta/model``), e.g. to serve
    an exported or converted model; training writes the same layout with optimizer state."""
    mgr = ocp.CheckpointManager(os.path.abspath(directory), item_names=ITEMS,
                                options=ocp.CheckpointManagerOptions(create=True))
    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params}),
        meta=ocp.args.JsonSave({"model": config_json(cfg)})), force=True)
    mgr.wait_until_finished()
    mgr.close()
