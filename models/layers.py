"""Transformer building blocks in Flax NNX. Logical axis names only (see models/config.py
for the shape-letter legend).

Parameters carry their logical axes in Flax's ``out_sharding`` metadata with eager sharding
off: the names are resolved to mesh axes by ``triax.sharding``, never here.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models.attention import attention
from triax.models.visibility import Visibility
from triax.models.axes import constrain
from triax.models.config import ModelConfig, RopeScaling
from triax.models.decode import Cache, cached_attention
from triax.models.lora import maybe_pair
from triax.models.projection import RESIDUAL, project_in, project_out
from triax.models.quantize import quantize_weights
from triax.models.runtime import ExecConfig


def param(rngs: nnx.Rngs, shape, logical_axes, std: float | None, dtype=jnp.float32) -> nnx.Param:
    """A parameter with logical axes; ``std=None`` means ones (norm scales)."""
    if std is None:
        value = jnp.ones(shape, dtype)
    else:
        value = std * jax.random.normal(rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=tuple(logical_axes), eager_sharding=False)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs):
        self.scale = param(rngs, (dim,), ("norm",), None)
        self.eps = eps

    def __call__(self, x_BTD):
        x32 = x_BTD.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x32.ndim - 1) + (-1,))
        return (y * scale).astype(x_BTD.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None):
    """RoPE inverse frequencies ``[H/2]``, with Llama 3.1's scaling when given (the formula
    of Hugging Face's ``_compute_llama3_parameters``)."""
    freq = theta ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)
    if scaling is None:
        return freq
    s = scaling
    wavelen = 2 * math.pi / freq
    low_wavelen = s.original_max_seq_len / s.low_freq_factor   # longer: stretched by factor
    high_wavelen = s.original_max_seq_len / s.high_freq_factor  # shorter: kept
    scaled = jnp.where(wavelen > low_wavelen, freq / s.factor, freq)
    smooth = ((s.original_max_seq_len / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope(x_BTNH, positions_BT, theta: float, scaling: Optional[RopeScaling] = None):
    """Rotary position embedding (half-split layout)."""
    H = x_BTNH.shape[-1]
    freq = rope_frequencies(H, theta, scaling)
    angle_BTh = positions_BT[..., None].astype(jnp.float32) * freq[None, None, :]
    sin, cos = jnp.sin(angle_BTh)[:, :, None, :], jnp.cos(angle_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


class Attention(nnx.Module):
    """Megatron layout: QKV column-parallel over heads, output row-parallel."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        std = cfg.init_std
        self.wq_DNH = param(rngs, (D, N, H), ("embed", "heads", "head_dim"), std)
        self.wk_DKH = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.wv_DKH = param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), std)
        self.wo_NHD = param(rngs, (N, H, D), ("heads", "head_dim", "embed"), std)
        self.theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        # LoRA adapters (None where not targeted): A on the input axes, B on the output's.
        self.lora_q_proj = maybe_pair(cfg, "q_proj", rngs)
        self.lora_k_proj = maybe_pair(cfg, "k_proj", rngs)
        self.lora_v_proj = maybe_pair(cfg, "v_proj", rngs)
        self.lora_o_proj = maybe_pair(cfg, "o_proj", rngs)
        quantize_weights(self, cfg, wq_DNH=1, wk_DKH=1, wv_DKH=1, wo_NHD=2)  # int8 only

    def project_qkv(self, x_BTD, positions_BT, dtype):
        kv_out = ("batch", "seq", "act_kv_heads", "act_head_dim")
        q, k, v = project_in(x_BTD, [
            ("BTD,DNH->BTNH", self, "wq_DNH", ("embed", "heads", "head_dim"),
             ("batch", "seq", "act_heads", "act_head_dim")),
            ("BTD,DKH->BTKH", self, "wk_DKH", ("embed", "kv_heads", "head_dim"), kv_out),
            ("BTD,DKH->BTKH", self, "wv_DKH", ("embed", "kv_heads", "head_dim"), kv_out)],
            dtype)
        q, k, v = (y if ad is None else y + ad(x_BTD, dtype) for y, ad in
                   ((q, self.lora_q_proj), (k, self.lora_k_proj), (v, self.lora_v_proj)))
        q = rope(q, positions_BT, self.theta, self.rope_scaling)
        k = rope(k, positions_BT, self.theta, self.rope_scaling)
        q = constrain(q, ("batch", "seq", "act_heads", None))
        k = constrain(k, ("batch", "seq", "act_kv_heads", None))
        v = constrain(v, ("batch", "seq", "act_kv_heads", None))
        return q, k, v

    def output(self, o_BTNH, dtype):
        out = project_out(o_BTNH, ("batch", "seq", "act_heads", "act_head_dim"),
                          ("BTNH,NHD->BTD", self, "wo_NHD", ("heads", "head_dim", "embed"),
                           RESIDUAL), dtype)
        if self.lora_o_proj is not None:
            out = out + self.lora_o_proj(o_BTNH, dtype)
        # Back on the residual stream (``res_seq``: split over the sequence under SP).
        return constrain(out, ("batch", "res_seq", "act_embed"))

    def __call__(self, x_BTD, positions_BT, vis: Optional[Visibility], exe: ExecConfig,
                 cache: Optional[Cache] = None):
        """``(out_BTD, cache)``. Without a cache the ``T`` tokens attend to each other as
        ``vis`` says (causal when None); with this layer's cache (``[B, S, K, H]``) their
        keys/values are written at ``positions_BT`` and the queries attend over the cache
        (``vis`` is ignored)."""
        q, k, v = self.project_qkv(x_BTD, positions_BT, exe.dtype)
        if cache is not None:
            o, cache = cached_attention(q, k, v, cache, positions_BT, exe.attention)
            return self.output(o, exe.dtype), cache
        if vis is None:
            vis = Visibility.causal(*x_BTD.shape[:2])
        return self.output(attention(q, k, v, vis, exe.attention), exe.dtype), cache


class MLP(nnx.Module):
    """SwiGLU: gate and up fused into one column-parallel weight over ``mlp`` (so the
    backward needs one input-gradient all-reduce, not two); down is row-parallel."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F, std = cfg.embed_dim, cfg.mlp_dim, cfg.init_std
        self.w_in_D2F = param(rngs, (D, 2, F), ("embed", None, "mlp"), std)
        self.w_down_FD = param(rngs, (F, D), ("mlp", "embed"), std)
        # One adapter pair per projection of the fused weight (PEFT's gate_proj, up_proj).
        self.lora_gate_proj = maybe_pair(cfg, "gate_proj", rngs)
        self.lora_up_proj = maybe_pair(cfg, "up_proj", rngs)
        self.lora_down_proj = maybe_pair(cfg, "down_proj", rngs)
        quantize_weights(self, cfg, w_in_D2F=1, w_down_FD=1)

    def __call__(self, x_BTD, dtype):
        gu, = project_in(x_BTD, [("BTD,DUF->BTUF", self, "w_in_D2F", ("embed", None, "mlp"),
                                  ("batch", "seq", None, "act_mlp"))], dtype)
        g, u = gu[:, :, 0], gu[:, :, 1]
        g = g if self.lora_gate_proj is None else g + self.lora_gate_proj(x_BTD, dtype)
        u = u if self.lora_up_proj is None else u + self.lora_up_proj(x_BTD, dtype)
        h = constrain(jax.nn.silu(g) * u, ("batch", "seq", "act_mlp"))
        out = project_out(h, ("batch", "seq", "act_mlp"),
                          ("BTF,FD->BTD", self, "w_down_FD", ("mlp", "embed"), RESIDUAL), dtype)
        if self.lora_down_proj is not None:
            out = out + self.lora_down_proj(h, dtype)
        return constrain(out, ("batch", "res_seq", "act_embed")), {}


class Embed(nnx.Module):
    """Vocabulary-parallel embedding (rows over ``vocab``)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.table_VD = param(rngs, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"),
                              cfg.init_std)

    def __call__(self, tokens_BT, dtype):
        x = jnp.take(self.table_VD[...].astype(dtype), tokens_BT, axis=0)
        return constrain(x, ("batch", "res_seq", "act_embed"))

    def attend(self, x_BTD, dtype):
        """Tied output projection: logits against the embedding table."""
        return jnp.einsum("BTD,VD->BTV", x_BTD, self.table_VD[...].astype(dtype))
