"""The Llama-style decoder: stacked blocks scanned over a leading ``layers`` axis.

The stack is one NNX module whose parameters carry a leading ``layers`` axis (built with
``nnx.vmap``), so the pipeline can split it over stages and the forward compiles one block.
The same block forward serves training and generation: given a KV cache (one ``[B, S, K, H]``
layer of it per block, scanned with the stack) it writes the new keys/values and attends over
the cache (see ``triax.models.decode``).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from triax.models import Transformer, config
    >>> model = Transformer(config.TINY, nnx.Rngs(0))
    >>> logits_BTV, aux = model(jnp.zeros((2, 16), jnp.int32))
    >>> logits_BTV.shape
    (2, 16, 264)
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models import moe
from triax.models.axes import constrain
from triax.models.config import ModelConfig
from triax.models.decode import Cache
from triax.models.attention import Visibility
from triax.models.layers import MLP, Attention, Embed, ExecConfig, RMSNorm, param

REMAT_POLICIES: dict[str, Optional[Callable]] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)); x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.mlp = MLP(cfg, rngs) if cfg.moe is None else moe.MoE(cfg, rngs)

    def __call__(self, x_BTD, positions_BT, vis: Optional[Visibility], exe: ExecConfig,
                 cache: Optional[Cache] = None):
        """``(x_BTD, aux, cache)``; ``cache`` is this layer's KV cache or None (see
        ``Attention.__call__``)."""
        a_BTD, cache = self.attn(self.attn_norm(x_BTD), positions_BT, vis, exe, cache)
        x_BTD = x_BTD + a_BTD
        y_BTD, aux = self.mlp(self.mlp_norm(x_BTD), exe.dtype)
        return constrain(x_BTD + y_BTD, ("batch", "res_seq", "act_embed")), aux, cache


def aux_zeros(cfg: ModelConfig) -> dict:
    """The per-step auxiliary scalars a block stack accumulates (empty for dense models)."""
    return {} if cfg.moe is None else moe.aux_zeros()


def scan_blocks(block_graphdef, stacked_state, x_BTD, positions_BT, vis, cfg: ModelConfig,
                exe: ExecConfig, cache: Optional[Cache] = None):
    """Run a stack of blocks (any leading layer count) with ``lax.scan``.

    Pure function of the stacked state, so pipeline stages call it on their slice. ``cache``
    (leaves ``[L, B, S, K, H]`` for the same ``L`` layers) is scanned alongside the
    parameters. Returns ``(x_BTD, aux, cache)``: aux sums the blocks' auxiliary scalars,
    cache is the updated cache (None without one).
    """
    def body(carry, layer):
        x, aux = carry
        layer_state, layer_cache = layer
        y, a, layer_cache = nnx.merge(block_graphdef, layer_state)(x, positions_BT, vis, exe,
                                                                   layer_cache)
        return (y, jax.tree.map(jnp.add, aux, a)), layer_cache

    if exe.remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[exe.remat], prevent_cse=False)
    (x_BTD, aux), cache = jax.lax.scan(body, (x_BTD, aux_zeros(cfg)), (stacked_state, cache))
    return x_BTD, aux, cache


class Transformer(nnx.Module):
    """Decoder-only transformer. ``__call__(tokens_BT) -> (logits_BTV, aux)``.

    The pipeline runs it as three pieces (``triax.pipeline.stage.StackedModel``):
    ``embed_tokens`` before the stack, ``run_blocks`` on each stage's slice of ``blocks``,
    ``logits`` after it (the loss is ``triax.models.loss``).
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        if not cfg.tie_embeddings:
            self.head_DV = param(rngs, (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"),
                                 cfg.init_std)

    def embed_tokens(self, tokens_BT, exe: ExecConfig = ExecConfig()):
        return self.embed(tokens_BT, exe.dtype)

    def run_blocks(self, x_BTD, positions_BT=None, vis: Optional[Visibility] = None,
                   exe: ExecConfig = ExecConfig(), cache: Optional[Cache] = None):
        """``(x_BTD, aux, cache)`` after every block. Positions default to ``0..T-1``; without
        a cache, who sees whom defaults to causal (``triax.models.attention.Visibility``),
        with one it comes from the cache positions."""
        B, T = x_BTD.shape[:2]
        if positions_BT is None:
            if cache is not None:
                raise ValueError("run_blocks with a KV cache needs positions_BT: the cache "
                                 "position of every new token")
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if vis is None and cache is None:
            vis = Visibility.causal(B, T)
        gd, st = nnx.split(self.blocks)
        return scan_blocks(gd, st, x_BTD, positions_BT, vis, self.cfg, exe, cache)

    def logits(self, x_BTD, exe: ExecConfig = ExecConfig()):
        x_BTD = self.final_norm(x_BTD)
        if self.cfg.tie_embeddings:
            out = self.embed.attend(x_BTD, exe.dtype)
        else:
            out = jnp.einsum("BTD,DV->BTV", x_BTD, self.head_DV[...].astype(exe.dtype))
        return constrain(out, ("batch", "seq", "act_vocab"))

    def __call__(self, tokens_BT, positions_BT=None, vis: Optional[Visibility] = None,
                 exe: ExecConfig = ExecConfig(), cache: Optional[Cache] = None):
        """``(logits_BTV, aux)``; with a KV ``cache`` (``triax.models.decode``) the new
        tokens sit at ``positions_BT`` and ``(logits_BTV, aux, cache)`` is returned."""
        x = self.embed_tokens(tokens_BT, exe)
        x, aux, new_cache = self.run_blocks(x, positions_BT, vis, exe, cache)
        logits_BTV = self.logits(x, exe)
        return (logits_BTV, aux) if cache is None else (logits_BTV, aux, new_cache)
