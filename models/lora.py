"""LoRA adapters over a frozen base: the config, the adapter pair, and which leaves train.

An adapter on a base weight ``W`` (input dims ``I``, output dims ``O``) adds
``x·A·B·(alpha/r)``: ``A`` is ``I + (r,)`` with the base's input logical axes and
``lora_rank``; ``B`` is ``(r,) + O`` with ``lora_rank`` and the base's output axes, so the
rules table shards an adapter like its base weight (``lora_rank`` itself is replicated: it
maps to no mesh axis). ``B`` starts at zero, so step 0 computes the base model.

Dropout (PEFT's ``lora_dropout``: ``B(A(dropout(x)))·alpha/r``) runs only where the batch
carries per-token seeds (:func:`dropout_seeds`, which the training step adds; eval and decode
never do). Each token's keep-mask is drawn from its own seed, the layer (its index in the
whole stack, ``protocol.current_layer``, which a pipeline stage passes for its chunk) and the
target, so it travels with the token through the zigzag context layout, micro-batches and
pipeline stages and is the same on every sharding.

Adapter parameters live in sub-modules named ``lora_<peft module>`` (``lora_q_proj``, …);
:func:`is_adapter_path` is the one test of "trainable", and :func:`freeze_base` stops the
gradient of every other leaf where a module is rebuilt from its parameters, so no
weight-gradient matmul of the base is ever traced (plain or pipelined, split backward too).

    >>> from triax.models import config
    >>> cfg = config.TINY.replace(lora=LoraConfig(rank=4))
    >>> param_count(cfg.lora, cfg)
    15872
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from triax.choices import PEFT_TARGETS
from triax.models import runtime
from triax.models.config import LoraConfig
from triax.models.lora_table import LoraTable
from triax.models.quantize import dequantized

PREFIX = "lora_"
# The batch key of the per-token dropout seeds (uint32 [B, T]) a training step adds.
DROPOUT_SEEDS = "lora_dropout_seeds"
_DROPOUT_ROOT = 0x1a7a   # the root of every step's dropout key (any constant: fixed per run)


def dropout_seeds(step, shape_BT) -> jax.Array:
    """uint32 ``shape_BT``: one dropout seed per token for optimizer step ``step`` (the
    values depend on the step only, never on the sharding)."""
    key = jax.random.fold_in(jax.random.key(_DROPOUT_ROOT), step)
    return jax.random.bits(key, tuple(shape_BT), jnp.uint32)


def with_dropout_seeds(batch: dict, lora: Optional[LoraConfig], step) -> dict:
    """``batch`` plus this step's seeds when ``lora`` has dropout (else unchanged)."""
    if lora is None or lora.dropout == 0:
        return batch
    return {**batch, DROPOUT_SEEDS: dropout_seeds(step, batch["inputs"].shape[:2])}


def layer_dropout(batch: dict, layer) -> Optional[tuple]:
    """The runtime's ``lora_dropout`` while a block runs ``batch`` in layer ``layer`` (an
    int32 scalar, its index in the whole stack): the adapters then drop inputs with the
    batch's seeds; a batch without seeds (eval, decode): None, no dropout."""
    seeds = batch.get(DROPOUT_SEEDS)
    return None if seeds is None else (seeds, layer)


class LoraPair(nnx.Module):
    """``A`` (in dims, r) and ``B`` (r, out dims); ``__call__(x, n_in)`` is
    ``x·A·B·scale`` contracting the last ``n_in`` dims of ``x``."""

    def __init__(self, in_shape, in_axes, out_shape, out_axes, lora: LoraConfig,
                 rngs: nnx.Rngs, target: str):
        r, fan_in = lora.rank, math.prod(in_shape)
        # PEFT's default: A ~ kaiming-uniform (bound 1/sqrt(fan_in)), B = 0.
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), tuple(in_shape) + (r,), jnp.float32,
                               -bound, bound)
        self.a = nnx.Param(a, out_sharding=tuple(in_axes) + ("lora_rank",),
                           eager_sharding=False)
        self.b = nnx.Param(jnp.zeros((r,) + tuple(out_shape), jnp.float32),
                           out_sharding=("lora_rank",) + tuple(out_axes), eager_sharding=False)
        self.scale, self.dropout = lora.scale, lora.dropout
        self.salt = PEFT_TARGETS.index(target)   # each target draws its own mask

    def dropped(self, x):
        """``x`` (``[B, T, *in]``) with inputs zeroed with probability ``dropout`` and the
        rest scaled by ``1/(1-dropout)`` where a training step's seeds are active."""
        active = runtime.current().lora_dropout
        if active is None or self.dropout == 0:
            return x
        seeds_BT, layer = active
        in_shape, keep_p = x.shape[2:], 1.0 - self.dropout
        salt = jnp.asarray(layer, jnp.uint32) * len(PEFT_TARGETS) + self.salt

        def keep(seed):   # one token's mask: its own threefry key (seed, layer·targets+salt)
            key = jax.random.wrap_key_data(jnp.stack([seed, salt]))
            return jax.random.bernoulli(key, keep_p, in_shape)
        keep_BTI = jax.vmap(jax.vmap(keep))(seeds_BT)
        return jnp.where(keep_BTI, x / jnp.asarray(keep_p, x.dtype), 0).astype(x.dtype)

    def __call__(self, x, dtype):
        n_in = self.a.ndim - 1
        x = self.dropped(x)
        z = jnp.tensordot(x, self.a[...].astype(dtype), axes=n_in)
        return jnp.tensordot(z, self.b[...].astype(dtype), axes=1) * jnp.asarray(self.scale,
                                                                                 dtype)


def maybe_pair(cfg, target: str, rngs: nnx.Rngs):
    """A pair for ``target`` shaped as ``cfg.lora_io`` says when ``cfg.lora`` adapts it (a
    serving table of them, ``models.lora_table.LoraTable``, when ``cfg.lora.slots``), else
    None."""
    if cfg.lora is None or target not in cfg.lora.targets:
        return None
    kind = LoraTable if cfg.lora.slots else LoraPair
    return kind(*cfg.lora_io(target), cfg.lora, rngs, target)


def pair_leaf(path) -> Optional[tuple[str, str]]:
    """``(target, "a" | "b")`` of an adapter leaf's path (a sequence of keys): which target's
    pair and which factor (``a`` on the base's input side, ``b`` on its output side); None
    for any other leaf."""
    keys = [str(getattr(k, "key", k)) for k in path]
    for i, k in enumerate(keys[:-1]):
        if k.startswith(PREFIX) and keys[i + 1] in ("a", "b"):
            return k[len(PREFIX):], keys[i + 1]
    return None


def is_adapter_path(path) -> bool:
    """A leaf is an adapter when a key on its path is a ``lora_*`` sub-module."""
    return any(str(getattr(k, "key", k)).startswith(PREFIX) for k in path)


def has_adapters(tree) -> bool:
    return any(is_adapter_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def split(tree: dict) -> tuple[dict, dict]:
    """``(adapters, base)``: the nested dict cut in two (empty branches dropped)."""
    ad, base = {}, {}
    for k, v in tree.items():
        if str(k).startswith(PREFIX):
            ad[k] = v
        elif isinstance(v, dict):
            a, b = split(v)
            if a:
                ad[k] = a
            if b:
                base[k] = b
        else:
            base[k] = v
    return ad, base


def join(a: dict, b: dict) -> dict:
    """The union of two disjoint nested dicts (``split``'s inverse)."""
    out = dict(b)
    for k, v in a.items():
        out[k] = join(v, out[k]) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def freeze_base(params):
    """``params`` with the gradient of every non-adapter leaf stopped, when it has adapters
    (otherwise unchanged): applied where the module is rebuilt, inside any differentiation."""
    if not has_adapters(params):
        return params
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if is_adapter_path(p) else jax.lax.stop_gradient(x), params)


def cast_base(module: nnx.Module, dtype) -> None:
    """Store every non-adapter parameter of ``module`` in ``dtype`` (the frozen base)."""
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param) and not is_adapter_path(path):
            node.value = node.value.astype(dtype)


# Where each target's adapter sits and which base weight it adds to (index: the fused pair's
# slot of ``w_in_D2F``).
WEIGHTS = {"q_proj": ("attn", "wq_DNH", None), "k_proj": ("attn", "wk_DKH", None),
           "v_proj": ("attn", "wv_DKH", None), "o_proj": ("attn", "wo_NHD", None),
           "gate_proj": ("mlp", "w_in_D2F", 0), "up_proj": ("mlp", "w_in_D2F", 1),
           "down_proj": ("mlp", "w_down_FD", None)}


def delta(pair: dict, scale: float):
    """``scale · A·B`` of a stacked pair (``a`` [L, *in, r], ``b`` [L, r, *out]) in fp32:
    the change the adapter makes to its base weight, shaped [L, *in, *out]."""
    a, b = pair["a"].astype(jnp.float32), pair["b"].astype(jnp.float32)
    L, r = a.shape[0], a.shape[-1]
    ab = jnp.einsum("LIR,LRO->LIO", a.reshape(L, -1, r), b.reshape(L, r, -1))
    return scale * ab.reshape(a.shape[:-1] + b.shape[2:])


def merged(params: dict, lora: LoraConfig) -> dict:
    """The base parameters with every adapter folded in (``W + A·B·alpha/r``, fp32): the
    plain model a merged export writes (an int8 base dequantized first)."""
    _, base = split(params)
    base = jax.tree.map(lambda x: x.astype(jnp.float32), dequantized(base))
    blocks = {k: dict(v) for k, v in base["blocks"].items()}
    for t in lora.targets:
        mod, name, slot = WEIGHTS[t]
        d = delta(params["blocks"][mod][PREFIX + t], lora.scale)
        w = blocks[mod][name]
        blocks[mod][name] = w + d if slot is None else w.at[:, :, slot].add(d)
    return {**base, "blocks": blocks}


def param_count(lora: LoraConfig, cfg) -> int:
    """Adapter parameters of ``cfg`` with ``lora`` (``ModelConfig.adapter_params``)."""
    return cfg.replace(lora=lora).adapter_params
