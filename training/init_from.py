"""``--init-from DIR``: fine-tune a Hugging Face model. The model comes from DIR's
``config.json`` (``triax.hf``), the starting weights from its safetensors, loaded straight
onto the run's mesh with the trainer's shardings; the optimizer starts fresh.
"""
from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp

from triax.hf.load import load_params, read_model_config
from triax.hf.tokenizer import FILE, load_tokenizer
from triax.models.config import ModelConfig
from triax.training.config import RunConfig, RunConfigWarning

# RunConfig's own default model: the one value of --model that --init-from may leave set.
_DEFAULT_MODEL = next(f.default for f in dataclasses.fields(RunConfig) if f.name == "model")


def init_from_config(run: RunConfig) -> ModelConfig:
    """DIR's model; a ``--model`` or ``--num-layers`` that would contradict it is an error.
    ``--seq-len`` past the context it was trained on lengthens it (RoPE needs no table), with
    a warning: the positions past it are untrained, not impossible."""
    cfg = read_model_config(run.init_from)
    if run.model not in (_DEFAULT_MODEL, cfg.name):
        raise ValueError(f"--model {run.model!r} conflicts with --init-from {run.init_from!r}: "
                         f"the model comes from its config.json ({cfg.name}); drop --model")
    if os.path.isfile(os.path.join(run.init_from, FILE)):  # ids it makes must fit the model
        load_tokenizer(run.init_from, cfg)
    if run.num_layers not in (None, cfg.num_layers):
        raise ValueError(f"--num-layers {run.num_layers} conflicts with --init-from "
                         f"{run.init_from!r} ({cfg.num_layers} layers); drop --num-layers")
    if run.seq_len > cfg.max_seq_len:
        warnings.warn(f"--seq-len {run.seq_len} is longer than the context {cfg.name} was "
                      f"trained on ({run.init_from!r}, max_seq_len {cfg.max_seq_len}): "
                      f"training past it, on positions the model has not seen",
                      RunConfigWarning, stacklevel=2)
    context = run.max_seq_len or max(run.seq_len, cfg.max_seq_len)
    return cfg.replace(max_seq_len=context)


def initial_state(trainer, cfg: ModelConfig, directory: str):
    """The train state at step 0 with DIR's weights (placed as the trainer shards them)."""
    params, _ = load_params(directory, cfg, trainer.mesh, trainer.strategy)
    make = jax.jit(lambda p: {"params": p, "opt_state": trainer.tx.init(p),
                              "step": jnp.zeros((), jnp.int32)},
                   out_shardings=trainer.state_shardings, donate_argnums=0)
    return make(params)


__all__ = ["init_from_config", "initial_state"]
