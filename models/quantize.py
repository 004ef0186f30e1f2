"""Weight-only int8: a frozen LoRA base (``--base-dtype int8``) and served weights
(``triax serve --quantize int8``, :func:`served_config`).

A projection weight ``W`` laid out input dims first (``n_in`` of them), output dims last, is
stored as ``W_q = round(W / s)`` in int8 with one fp32 scale per output channel,
``s = max|W| / 127`` over the input dims (symmetric). The scale is a sibling parameter
``<name>_scale`` shaped like ``W`` with its input dims kept as 1, carrying the weight's output
logical axes (``None`` on the unit dims), so the rules shard it like the weight; ``W_q``
keeps the weight's axes. The step receives ``W_q``; :func:`project` converts it to the
compute dtype (exact) for the matmul and scales the product per output channel
(``(x · W_q) s = x · (W_q s)``); the collective-matmul hooks take :func:`kernel`'s
dequantized ``W_q · s``.

Quantized: the block projections (attention q/k/v/o, the dense MLP's fused gate|up and
down), targeted or not. Embedding, head, norms and MoE experts stay fp32: the norms and
embedding are no matmul weight, and the vocab-sized head sets the logits directly.
A model quantizes when :func:`stores_int8` says so: its LoRA base is int8, or (no LoRA)
``ModelConfig.quantize`` is. Served, the int8 leaves stay int8 and the float ones take the
served dtype (:func:`served_dtype`), which is how the engine places them and the planner
prices them.

    >>> import jax.numpy as jnp
    >>> q, s = quantize(jnp.array([[1.0, -4.0], [-0.5, 2.0]]), n_in=1)
    >>> q.tolist(), (s * 127).tolist()
    ([[127, -127], [-64, 64]], [[1.0, 4.0]])
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from triax.choices import QUANTIZE, QUANTIZED_BASE
from triax.models import fp8, runtime
from triax.models.config import ModelConfig

SUFFIX = "_scale"


def quantize(w, n_in: int):
    """``(w_q int8, scale fp32)``: ``scale`` is ``w``'s shape with the ``n_in`` input dims
    kept as 1 (so it broadcasts, stacked under ``layers`` too)."""
    return _quantize(w, tuple(range(n_in)))


def _quantize(w, axes):
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)   # an all-zero channel stays exact
    return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale


def stores_int8(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s block projections are stored int8 (an int8 LoRA base, or served
    ``--quantize int8``)."""
    if cfg.lora is not None:
        return cfg.lora.base_dtype == QUANTIZED_BASE
    return cfg.quantize == QUANTIZED_BASE


def served_config(cfg: ModelConfig, quantize: str) -> ModelConfig:
    """``cfg`` as served under ``--quantize`` (``none``: as it is): int8 projections are its
    LoRA base's dtype when it has adapters (served unmerged over that base), else its
    ``quantize``. MoE is refused: its experts, most of its weights, have no int8 form."""
    if quantize not in QUANTIZE:
        raise ValueError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE)}")
    if quantize == "none" or stores_int8(cfg):
        return cfg
    if cfg.moe is not None:
        raise ValueError(f"--quantize {quantize} on the MoE model {cfg.name!r}: its experts "
                         f"(most of its weights) have no int8 form, only its attention "
                         f"would be; serve it with --quantize none")
    if cfg.lora is not None:
        return cfg.replace(lora=dataclasses.replace(cfg.lora, base_dtype=quantize))
    return cfg.replace(quantize=quantize)


def served_dtype(leaf_dtype, dtype: str):
    """A parameter's dtype as served in ``dtype``: fp32 leaves in ``dtype``; others (int8
    projections, a bf16 base) as they are.

    >>> served_dtype(jnp.float32, "bfloat16"), served_dtype(jnp.int8, "bfloat16")
    (dtype(bfloat16), dtype('int8'))
    """
    return jnp.dtype(dtype) if jnp.dtype(leaf_dtype) == jnp.float32 else jnp.dtype(leaf_dtype)


def quantize_weights(module: nnx.Module, cfg: ModelConfig, **n_in: int) -> None:
    """When ``cfg`` stores int8 projections (:func:`stores_int8`), replace each named weight
    of ``module`` by its int8 values and add its ``<name>_scale`` (``n_in``: that weight's
    count of input dims)."""
    if not stores_int8(cfg):
        return
    for name, k in n_in.items():
        p = getattr(module, name)
        q, s = quantize(p[...], k)
        p.set_value(q)
        axes = (None,) * k + tuple(p.out_sharding)[k:]
        setattr(module, name + SUFFIX, nnx.Param(s, out_sharding=axes, eager_sharding=False))


def project(spec: str, x, module: nnx.Module, name: str, dtype):
    """``einsum(spec, x, W)`` for the weight ``name`` of ``module`` in ``dtype``: in float8
    when the runtime's ``ExecConfig.fp8`` says so (``models.fp8``; the fp32 weight is cast
    where it is stored); an int8 weight converted (exactly: |q| <= 127 fits ``dtype``) with
    its per-output-channel scale applied to the product (``y = (x · q) s``, the same sum);
    else with :func:`kernel`'s weight."""
    s = getattr(module, name + SUFFIX, None)
    if runtime.current().exe.fp8 and s is None:
        p = getattr(module, name)
        return fp8.einsum(spec, x, p[...], dtype, tuple(getattr(p, "out_sharding", ()) or ()))
    out_scale = None if s is None else _output_scale(spec, s[...])
    if out_scale is None:
        return jnp.einsum(spec, x, kernel(module, name, dtype))
    y = jnp.einsum(spec, x, getattr(module, name)[...].astype(dtype))
    return (y * out_scale).astype(y.dtype)


def _output_scale(spec: str, s):
    """The scale ``s`` (the weight's shape, input dims 1) shaped to broadcast over ``spec``'s
    output (its output dims last there, the rest 1); None when the weight's output dims are
    not the output's last ones, in order (then the weight is dequantized instead).

    >>> _output_scale("BTD,DNH->BTNH", jnp.ones((1, 4, 2))).shape
    (1, 1, 4, 2)
    """
    (x_l, w_l), out_l = spec.split("->")[0].split(","), spec.split("->")[1]
    kept = [c for c in w_l if c not in x_l]
    if not out_l.endswith("".join(kept)):
        return None
    dims = [d for c, d in zip(w_l, s.shape) if c not in x_l]
    return s.reshape([1] * (len(out_l) - len(dims)) + dims)


def kernel(module: nnx.Module, name: str, dtype):
    """The weight ``name`` of ``module`` in ``dtype``, dequantized if it is int8."""
    w = getattr(module, name)[...]
    s = getattr(module, name + SUFFIX, None)
    if s is None:
        return w.astype(dtype)
    return (w.astype(jnp.float32) * s[...]).astype(dtype)


def cast_like(tree: dict, like: dict) -> dict:
    """A plain base parameter dict (fp32, as Hugging Face weights load) in the dtypes of
    ``like`` (the model's abstract base): each weight ``like`` quantizes becomes its int8 and
    scale (reduced over the scale's unit dims, the input dims), the rest cast."""
    out = {}
    for k, s in like.items():
        name = str(k)
        if isinstance(s, dict):
            out[k] = cast_like(tree[k], s)
        elif name + SUFFIX in like:
            axes = tuple(i for i, n in enumerate(like[name + SUFFIX].shape) if n == 1)
            out[k], out[name + SUFFIX] = _quantize(tree[k], axes)
        elif not (name.endswith(SUFFIX) and name[:-len(SUFFIX)] in like):
            out[k] = tree[k].astype(s.dtype)
    return out


def dequantized(tree: dict) -> dict:
    """A nested parameter dict with every ``(name, name_scale)`` pair replaced by ``name`` in
    fp32 (the plain weights a merged export writes); other leaves unchanged."""
    out = {}
    for k, v in tree.items():
        name = str(k)
        if isinstance(v, dict):
            out[k] = dequantized(v)
        elif name + SUFFIX in tree:
            out[k] = v.astype(jnp.float32) * tree[name + SUFFIX]
        elif not (name.endswith(SUFFIX) and name[:-len(SUFFIX)] in tree):
            out[k] = v
    return out
