"""What a checkpoint step holds: the item names, the meta JSON, config <-> JSON, config diff.

    >>> from triax.models import config
    >>> cfg = config.get("tiny", num_layers=2)
    >>> config_from_json(config_json(cfg)) == cfg
    True
    >>> model_config_diff(config_json(cfg), config.get("tiny", num_layers=1))
    {'num_layers': (2, 1)}
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import jax
from jax.sharding import Mesh

from triax.mesh import describe, mesh_sizes
from triax.models.config import LoraConfig, ModelConfig, MoEConfig, RopeScaling

STATE, META = "state", "meta"
ITEMS = (STATE, META)   # the Orbax item names of every step directory


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used as asked (corrupt, partial, mismatched)."""


class ModelMismatch(CheckpointError):
    """The checkpoint holds another model than the one asked for."""


class CorruptCheckpoint(CheckpointError):
    """A committed step that no longer reads back whole (files damaged, truncated, missing,
    or an array that does not match its checksum). ``cause`` says what; ``hint`` what to do."""

    def __init__(self, step: int, directory: str, cause: str, hint: str):
        self.step, self.directory, self.cause = step, directory, cause
        super().__init__(f"checkpoint step {step} in {directory!r} is corrupt or incomplete "
                         f"({cause}); {hint}")


# ---- config <-> JSON ----------------------------------------------------------------------
def config_json(obj: Any) -> Any:
    """A (possibly nested) config dataclass as plain JSON values (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(obj) if dataclasses.is_dataclass(obj)
                                 else obj, default=str))


def config_from_json(d: dict) -> ModelConfig:
    """The ``ModelConfig`` saved in a checkpoint's meta (``config_json``'s inverse)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise CheckpointError(f"checkpoint model config has unknown field(s) {unknown}; it "
                              f"was written by another triax version")
    d = dict(d)
    if d.get("moe") is not None:
        d["moe"] = MoEConfig(**d["moe"])
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if d.get("lora") is not None:
        d["lora"] = LoraConfig(**{**d["lora"], "targets": tuple(d["lora"]["targets"])})
    return ModelConfig(**d)


# ---- the config diff ----------------------------------------------------------------------
def model_config_diff(saved: "dict | ModelConfig", wanted: ModelConfig) -> dict[str, tuple]:
    """Fields whose saved value differs from ``wanted`` (name -> (saved, wanted))."""
    a = saved if isinstance(saved, dict) else config_json(saved)
    b = config_json(wanted)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def check_same_model(saved: "dict | ModelConfig", wanted: ModelConfig, where: str,
                     fix: str) -> None:
    """Raise ``ModelMismatch`` naming every differing field: "<where> holds a different model
    (num_layers: checkpoint 2 vs requested 1); <fix>"."""
    diff = model_config_diff(saved, wanted)
    if diff:
        fields = "; ".join(f"{k}: checkpoint {a!r} vs requested {b!r}"
                           for k, (a, b) in diff.items())
        raise ModelMismatch(f"{where} holds a different model ({fields}); {fix}")


# ---- the meta item ------------------------------------------------------------------------
def model_from_meta(meta: dict, where: str) -> ModelConfig:
    if "model" not in meta:
        raise CheckpointError(f"{where} has no model config in its meta item")
    return config_from_json(meta["model"])


def training_meta(step: int, data_position: int, seed: int, cfg: ModelConfig, run: dict,
                  mesh: Mesh, strategy: str, data_state: Optional[list] = None) -> dict:
    """The meta item training writes with every step (``inference`` reads only "model");
    ``data_state``: each process's data-iterator state, in process order."""
    return {"step": step, "data_position": data_position, "data_state": data_state,
            "rng": rng_json(seed, step),
            "model": config_json(cfg), "run": config_json(run), "mesh": describe(mesh),
            "mesh_sizes": mesh_sizes(mesh), "strategy": strategy,
            "num_devices": jax.device_count(), "num_processes": jax.process_count()}


def rng_json(seed: int, step: int) -> list[int]:
    """The run's PRNG key at ``step`` as plain ints (for the JSON meta)."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return [int(x) for x in jax.random.key_data(key).reshape(-1)]


def params_meta(cfg: ModelConfig) -> dict:
    """The meta item of a params-only export (what inference needs to rebuild the model)."""
    return {"model": config_json(cfg)}


def first_line(err: Exception) -> str:
    """An exception's first line, for messages that name the cause without a traceback."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


__all__ = ["ITEMS", "META", "STATE", "CheckpointError", "CorruptCheckpoint", "ModelMismatch", "check_same_model",
           "config_from_json", "config_json", "first_line", "model_config_diff",
           "model_from_meta", "params_meta", "rng_json", "training_meta"]
