"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT names a Llama adapter ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
(shape ``[r, in]``) and ``….lora_B.weight`` (``[out, r]``), ``torch.nn.Linear``'s layout; a
triax pair is stacked over layers, ``a`` ``[L, *in, r]`` and ``b`` ``[L, r, *out]``
(``models.lora``), so each PEFT tensor is one layer's ``a.T`` / ``b.T`` flattened. What is
read is checked against the model: an unsupported option (DoRA, rsLoRA, bias, per-module
ranks), a rank or targets other than the run's, a missing or extra key, a wrong shape, each
fails naming the field or key and what was expected.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import jax
import numpy as np
import safetensors.numpy

from triax.hf.export import umask_mode
from triax.hf.files import HFError
from triax.models.config import LoraConfig, ModelConfig
from triax.models import lora
from triax.models.lora import PREFIX, WEIGHTS
from triax.sharding.partition import abstract_model, param_shardings
from triax.choices import SERVE_STRATEGY

CONFIG = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_MODULE = {"attn": "self_attn", "mlp": "mlp"}
# Options triax's LoRA does not have: the value it needs (PEFT's default) for each.
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "bias": "none", "fan_in_fan_out": False,
                "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
                "alpha_pattern": {}, "use_qalora": False}


def peft_key(layer: int, target: str, which: str) -> str:
    """PEFT's key of one layer's ``lora_A`` / ``lora_B`` (``which``: "A" or "B")."""
    mod = _MODULE[WEIGHTS[target][0]]
    return f"base_model.model.model.layers.{layer}.{mod}.{target}.lora_{which}.weight"


def expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """PEFT key -> shape for every adapter tensor of ``cfg`` (which has ``lora``)."""
    r = cfg.lora.rank
    out = {}
    for i in range(cfg.num_layers):
        for t in cfg.lora.targets:
            in_shape, _, out_shape, _ = cfg.lora_io(t)
            fan_in, fan_out = math.prod(in_shape), math.prod(out_shape)
            out[peft_key(i, t, "A")] = (r, fan_in)
            out[peft_key(i, t, "B")] = (fan_out, r)
    return out


def adapter_config(lora: LoraConfig, base_model: str, dropout: float = 0.0) -> dict:
    """The ``adapter_config.json`` PEFT writes for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": dropout,
            "target_modules": list(lora.targets), "base_model_name_or_path": base_model,
            "inference_mode": True, "init_lora_weights": True, "revision": None, **_UNSUPPORTED}


def read_config(directory: str, expect: Optional[LoraConfig] = None) -> LoraConfig:
    """The ``LoraConfig`` of a PEFT directory; ``expect``: the run's, which must agree on
    rank and targets (alpha comes from the file)."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise HFError(f"adapter {directory!r}: no {CONFIG} (a PEFT adapter directory holds "
                      f"{CONFIG} and {WEIGHTS_FILE})")
    with open(path) as fh:
        raw = json.load(fh)
    if raw.get("peft_type") != "LORA":
        raise HFError(f"{path}: peft_type {raw.get('peft_type')!r}; only 'LORA' adapters load")
    for key, need in _UNSUPPORTED.items():
        value = raw.get(key)
        if not (value is None or value == need or (need is None and value == [])):
            raise HFError(f"{path}: {key}={raw[key]!r} is not supported (triax's LoRA needs "
                          f"{key}={need!r})")
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in raw:
            raise HFError(f"{path}: missing {key!r}")
    targets = raw["target_modules"]
    if isinstance(targets, str):
        targets = [targets]
    try:
        lora = LoraConfig(rank=int(raw["r"]), alpha=float(raw["lora_alpha"]),
                          targets=tuple(targets),
                          base_dtype=expect.base_dtype if expect else "float32")
    except ValueError as e:
        raise HFError(f"{path}: {e}") from None
    if expect is not None:
        if lora.rank != expect.rank:
            raise HFError(f"{path}: r={lora.rank} but the run asks --lora-rank {expect.rank}; "
                          f"give --lora-rank {lora.rank}")
        if lora.targets != expect.targets:
            raise HFError(f"{path}: target_modules={list(lora.targets)} but the run asks "
                          f"--lora-targets {','.join(expect.targets)}; give --lora-targets "
                          f"{','.join(lora.targets)}")
    return lora


def read_adapters(directory: str, cfg: ModelConfig) -> dict:
    """The adapter tree (host numpy, triax layout) of ``cfg`` from a PEFT directory."""
    path = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise HFError(f"adapter {directory!r}: no {WEIGHTS_FILE}")
    tensors = safetensors.numpy.load_file(path)
    want = expected(cfg)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise HFError(f"{path}: {'missing ' + repr(missing[:3]) if missing else ''}"
                      f"{'; ' if missing and extra else ''}"
                      f"{'unexpected ' + repr(extra[:3]) if extra else ''} "
                      f"(expected {len(want)} tensors for {cfg.num_layers} layers × targets "
                      f"{','.join(cfg.lora.targets)})")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise HFError(f"{path}: {k} has shape {tuple(tensors[k].shape)}, expected {shape} "
                          f"(rank {cfg.lora.rank} over this base model)")
    tree: dict = {"blocks": {}}
    for t in cfg.lora.targets:
        mod = WEIGHTS[t][0]
        i_shape, _, o_shape, _ = cfg.lora_io(t)
        r = cfg.lora.rank
        a = np.stack([tensors[peft_key(i, t, "A")].astype(np.float32).T.reshape(i_shape + (r,))
                      for i in range(cfg.num_layers)])
        b = np.stack([tensors[peft_key(i, t, "B")].astype(np.float32).T.reshape((r,) + o_shape)
                      for i in range(cfg.num_layers)])
        tree["blocks"].setdefault(mod, {})[PREFIX + t] = {"a": a, "b": b}
    return tree


def load_adapters(directory: str, cfg: ModelConfig, shardings: dict) -> dict:
    """:func:`read_adapters` placed with ``shardings`` (the trainer's adapter shardings)."""
    return jax.tree.map(jax.device_put, read_adapters(directory, cfg), shardings)


def load_adapted(model_dir: str, adapter: str, mesh, strategy=SERVE_STRATEGY,
                 name: Optional[str] = None) -> tuple[ModelConfig, dict]:
    """``(cfg, params)``: the HF base in ``model_dir`` with the PEFT ``adapter`` beside it,
    unmerged (the model computes ``x·W + x·A·B·alpha/r``), sharded on ``mesh``."""
    from triax.hf.load import load_params, read_model_config  # noqa: PLC0415 (load imports us)
    base_cfg = read_model_config(model_dir, name)
    cfg = adapted_config(base_cfg, adapter)
    base, _ = load_params(model_dir, base_cfg, mesh, strategy)
    shardings = lora.split(param_shardings(abstract_model(cfg), mesh, strategy))[0]
    return cfg, lora.join(load_adapters(adapter, cfg, shardings), base)


def adapted_config(base_cfg: ModelConfig, adapter: str) -> ModelConfig:
    """The base model's config with the adapter's ``LoraConfig`` (read, checked)."""
    try:
        return base_cfg.replace(lora=read_config(adapter))
    except ValueError as e:
        if isinstance(e, HFError):
            raise
        raise HFError(f"adapter {adapter!r}: {e}") from None


def write_adapters(params: dict, cfg: ModelConfig, out_dir: str, base_model: str,
                   dropout: float = 0.0) -> list[str]:
    """``adapter_model.safetensors`` + ``adapter_config.json`` of ``params``' adapters."""
    r = cfg.lora.rank
    tensors = {}
    for t in cfg.lora.targets:
        mod = WEIGHTS[t][0]
        pair = params["blocks"][mod][PREFIX + t]
        a, b = np.asarray(pair["a"], np.float32), np.asarray(pair["b"], np.float32)
        for i in range(cfg.num_layers):
            tensors[peft_key(i, t, "A")] = np.ascontiguousarray(a[i].reshape(-1, r).T)
            tensors[peft_key(i, t, "B")] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    os.makedirs(out_dir, exist_ok=True)
    safetensors.numpy.save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE),
                                metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG), "w") as fh:
        json.dump(adapter_config(cfg.lora, base_model, dropout), fh, indent=2)
    for f in (WEIGHTS_FILE, CONFIG):
        umask_mode(os.path.join(out_dir, f))
    return sorted(os.listdir(out_dir))


__all__ = ["CONFIG", "WEIGHTS_FILE", "adapted_config", "adapter_config", "expected",
           "load_adapted", "load_adapters",
           "peft_key", "read_adapters", "read_config", "write_adapters"]
