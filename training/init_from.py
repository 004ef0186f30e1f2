"""``--init-from DIR``: fine-tune a Hugging Face model. The model comes from DIR's
``config.json`` (``triax.hf``), the starting weights from its safetensors, loaded straight
onto the run's mesh with the trainer's shardings; the optimizer starts fresh.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Optional

import jax

from triax.hf.load import load_params, read_model_config
from triax.hf.peft import load_adapters, read_config
from triax.models import lora
from triax.sharding.partition import init_fn
from triax.hf.tokenizer import FILE, load_tokenizer
from triax.models.config import ModelConfig
from triax.models.quantize import cast_like
from triax.training.config_warning import RunConfigWarning

if TYPE_CHECKING:   # RunConfig.model_config calls here: the run is taken as it comes
    from triax.training.config import RunConfig


def init_from_config(run: RunConfig) -> ModelConfig:
    """DIR's model; a ``--model`` or ``--num-layers`` that would contradict it is an error.
    ``--seq-len`` past the context it was trained on lengthens it (RoPE needs no table), with
    a warning: the positions past it are untrained, not impossible."""
    src, seq_len = run.source, run.dataset.seq_len
    cfg = read_model_config(src.init_from)
    # RunConfig's own default model: the one value of --model that --init-from may leave set.
    default_model = next(f.default for f in dataclasses.fields(src) if f.name == "model")
    if src.model not in (default_model, cfg.name):
        raise ValueError(f"--model {src.model!r} conflicts with --init-from {src.init_from!r}: "
                         f"the model comes from its config.json ({cfg.name}); drop --model")
    if os.path.isfile(os.path.join(src.init_from, FILE)):  # ids it makes must fit the model
        load_tokenizer(src.init_from, cfg)
    if src.num_layers not in (None, cfg.num_layers):
        raise ValueError(f"--num-layers {src.num_layers} conflicts with --init-from "
                         f"{src.init_from!r} ({cfg.num_layers} layers); drop --num-layers")
    if seq_len > cfg.max_seq_len:
        warnings.warn(f"--seq-len {seq_len} is longer than the context {cfg.name} was "
                      f"trained on ({src.init_from!r}, max_seq_len {cfg.max_seq_len}): "
                      f"training past it, on positions the model has not seen",
                      RunConfigWarning, stacklevel=2)
    context = src.max_seq_len or max(seq_len, cfg.max_seq_len)
    return cfg.replace(max_seq_len=context)


def initial_state(trainer, cfg: ModelConfig, directory: str, adapter: Optional[str] = None,
                  seed: int = 0):
    """The train state at step 0 with DIR's weights (placed as the trainer shards them).
    With LoRA, the base comes from DIR (stored in the base dtype) and the adapters from the
    PEFT directory ``adapter`` or, without one, fresh (B = 0: step 0 is the base)."""
    if cfg.lora is None:
        params, _ = load_params(directory, cfg, trainer.mesh, trainer.model_strategy)
    else:
        params = lora_params(trainer, cfg, directory, adapter, seed)
    # DIR's weights are the model's form; the state stores uneven stages stage by stage.
    make = jax.jit(lambda p: trainer.fresh_state(trainer.to_stored(p)),
                   out_shardings=trainer.state_shardings, donate_argnums=0)
    return make(params)


def lora_params(trainer, cfg: ModelConfig, directory: str, adapter: Optional[str] = None,
                seed: int = 0) -> dict:
    """Base weights from the HF directory (cast, or int8-quantized, to ``--base-dtype``) joined
    with adapters from ``adapter`` (PEFT) or freshly initialised, all placed as ``trainer``
    shards them, in the model's own form (``Trainer.to_stored`` makes the state's)."""
    shardings = trainer.model_param_shardings
    base, _ = load_params(directory, cfg.replace(lora=None), trainer.mesh,
                          trainer.model_strategy)
    _, base_shardings = lora.split(shardings)
    _, base_shapes = lora.split(trainer.abstract.shapes)
    base = jax.jit(lambda b: cast_like(b, base_shapes), out_shardings=base_shardings,
                   donate_argnums=0)(base)
    ad_shardings = trainer.trainable(shardings)
    if adapter is not None:
        read_config(adapter, cfg.lora)
        adapters = load_adapters(adapter, cfg, ad_shardings)
    else:
        adapters = jax.jit(lambda: trainer.trainable(init_fn(trainer.abstract, seed)()),
                           out_shardings=ad_shardings)()
    return lora.join(adapters, base)


__all__ = ["init_from_config", "initial_state", "lora_params"]
