"""The Llama-style decoder: stacked blocks scanned over a leading ``layers`` axis.

The stack is one NNX module whose parameters carry a leading ``layers`` axis (built with
``nnx.vmap``), so the pipeline can split it over stages and the forward compiles one block.

    >>> from flax import nnx
    >>> from triax.models import Transformer, config
    >>> model = Transformer(config.TINY, nnx.Rngs(0))
    >>> logits_BTV, aux = model(jnp.zeros((2, 16), jnp.int32))
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models.axes import constrain
from triax.models.config import ModelConfig
from triax.models.layers import MLP, Attention, Embed, ExecConfig, RMSNorm, causal_mask, param

REMAT_POLICIES: dict[str, Optional[Callable]] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _make_ffn(cfg: ModelConfig, rngs: nnx.Rngs):
    if cfg.moe is None:
        return MLP(cfg, rngs)
    from triax.models.moe import MoE  # the MoE layer lives in its own file
    return MoE(cfg, rngs)


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)); x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        self.mlp = _make_ffn(cfg, rngs)

    def __call__(self, x_BTD, positions_BT, mask_BTS, dtype):
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT, mask_BTS, dtype)
        y_BTD, aux = self.mlp(self.mlp_norm(x_BTD), dtype)
        return constrain(x_BTD + y_BTD, ("batch", "seq", "act_embed")), aux


def aux_zeros(cfg: ModelConfig) -> dict:
    """The per-step auxiliary scalars a block stack accumulates (empty for dense models)."""
    if cfg.moe is None:
        return {}
    from triax.models.moe import aux_zeros as moe_aux_zeros
    return moe_aux_zeros()


def scan_blocks(block_graphdef, stacked_state, x_BTD, positions_BT, mask_BTS, cfg: ModelConfig,
                exe: ExecConfig):
    """Run a stack of blocks (any leading layer count) with ``lax.scan``.

    Pure function of the stacked state, so pipeline stages call it on their slice.
    Returns ``(x_BTD, aux)`` where aux sums the blocks' auxiliary scalars.
    """
    def body(carry, layer_state):
        x, aux = carry
        y, a = nnx.merge(block_graphdef, layer_state)(x, positions_BT, mask_BTS, exe.dtype)
        return (y, jax.tree.map(jnp.add, aux, a)), None

    policy = REMAT_POLICIES[exe.remat]
    if exe.remat != "none":
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    (x_BTD, aux), _ = jax.lax.scan(body, (x_BTD, aux_zeros(cfg)), stacked_state)
    return x_BTD, aux


class Transformer(nnx.Module):
    """Decoder-only transformer. ``__call__(tokens_BT) -> (logits_BTV, aux)``."""

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

    # The three pieces below are what pipeline stages run: embed on the first stage,
    # blocks everywhere, head on the last.
    def embed_tokens(self, tokens_BT, exe: ExecConfig = ExecConfig()):
        return self.embed(tokens_BT, exe.dtype)

    def run_blocks(self, x_BTD, positions_BT, mask_BTS, exe: ExecConfig = ExecConfig()):
        gd, st = nnx.split(self.blocks)
        return scan_blocks(gd, st, x_BTD, positions_BT, mask_BTS, self.cfg, exe)

    def logits(self, x_BTD, exe: ExecConfig = ExecConfig()):
        x_BTD = self.final_norm(x_BTD)
        if self.cfg.tie_embeddings:
            out = self.embed.attend(x_BTD, exe.dtype)
        else:
            out = jnp.einsum("BTD,DV->BTV", x_BTD, self.head_DV[...].astype(exe.dtype))
        return constrain(out, ("batch", "seq", "act_vocab"))

    def __call__(self, tokens_BT, positions_BT=None, mask_BTS=None,
                 exe: ExecConfig = ExecConfig()):
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if mask_BTS is None:
            mask_BTS = causal_mask(T, B)
        x = self.embed_tokens(tokens_BT, exe)
        x, aux = self.run_blocks(x, positions_BT, mask_BTS, exe)
        return self.logits(x, exe), aux


def cross_entropy(logits_BTV, targets_BT, weights_BT=None):
    """Mean next-token cross-entropy in fp32 (weights mask padding)."""
    logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
    if weights_BT is None:
        return jnp.mean(nll_BT)
    w = weights_BT.astype(jnp.float32)
    return jnp.sum(nll_BT * w) / jnp.maximum(jnp.sum(w), 1.0)
