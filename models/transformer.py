"""The Llama-style decoder: stacked blocks scanned over a leading ``layers`` axis, one user of
the model protocol (``triax.models.protocol``) as a user's own model is.

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

from typing import Optional

import jax.numpy as jnp
from flax import nnx

from triax.choices import QUANTIZED_BASE
from triax.models import moe, runtime
from triax.models.axes import constrain
from triax.models.config import ModelConfig
from triax.models.decode import Cache
from triax.models.visibility import Visibility, packed_visibility
from triax.models.layers import MLP, Attention, Embed, RMSNorm, param
from triax.models.lora import cast_base, layer_dropout
from triax.models.loss import head_nll_sum, loss_denominator
from triax.models.protocol import REMAT_POLICIES, current_exec, current_layer, run_stack
from triax.models.runtime import ExecConfig

__all__ = ["REMAT_POLICIES", "Block", "TokenEmbed", "Transformer"]

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


class TokenEmbed(Embed):
    """The token embedding as the protocol's pre-stack, ``embed(batch)``: the module stays at
    ``embed`` (its parameter path, which checkpoints and the HF layout name)."""

    def __call__(self, batch):
        return super().__call__(batch["inputs"], current_exec().dtype)


class Transformer(nnx.Module):
    """Decoder-only transformer. ``__call__(tokens_BT) -> (logits_BTV, aux)``.

    It follows the one model protocol (``triax.models.protocol.PipelineModel``), so the
    pipeline and the unpipelined loss run it as any model: ``embed`` (token embedding of
    ``batch["inputs"]``), ``block`` on each layer of ``blocks``, and ``head_loss`` (the summed
    next-token loss, ``triax.models.loss``) or, decoding, ``head_logits`` with the KV cache
    scanned alongside the blocks.
    """

    loss_metric = "ce"

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = TokenEmbed(cfg, rngs)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, rngs)
        if not cfg.tie_embeddings:
            self.head_DV = param(rngs, (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"),
                                 cfg.init_std)
        # bf16: a cast of the whole base; int8 quantized its projections in the layers.
        if cfg.lora is not None and cfg.lora.base_dtype not in ("float32", QUANTIZED_BASE):
            cast_base(self, jnp.dtype(cfg.lora.base_dtype))

    # ---- the protocol ----------------------------------------------------------------------
    def aux_zeros(self) -> dict:
        """The per-step auxiliary scalars the stack accumulates (empty for dense models)."""
        return {} if self.cfg.moe is None else moe.aux_zeros()

    def block_batch(self, batch, decoding: bool):
        """Positions (default ``0..T-1``; a KV cache needs them) and who sees whom (causal,
        or within packed documents; from the cache positions when decoding), once per stack."""
        B, T = batch["inputs"].shape[:2]
        positions_BT = batch.get("positions")
        if positions_BT is None:
            if decoding:
                raise ValueError("decoding with a KV cache needs positions_BT: the cache "
                                 "position of every new token")
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        vis = batch.get("vis", packed_visibility(batch.get("segment_ids"), batch.get("order")))
        if vis is None and not decoding:
            vis = Visibility.causal(B, T)
        return {**batch, "positions": positions_BT, "vis": vis}

    @staticmethod
    def block(block: Block, x_BTD, batch, cache: Optional[Cache] = None):
        # LoRA dropout: training steps only
        with runtime.using(lora_dropout=layer_dropout(batch, current_layer())):
            return block(x_BTD, batch["positions"], batch["vis"], current_exec(), cache)

    def head_loss(self, x_BTD, batch):
        """``Σ weight · nll`` of the next tokens (``exe.loss_chunks`` slices at a time)."""
        exe = current_exec()
        return head_nll_sum(lambda y_BTD: self.logits(y_BTD, exe), x_BTD, batch["targets"],
                            batch.get("weights"), exe.loss_chunks)

    def loss_weight(self, batch):
        return loss_denominator(batch["targets"], batch.get("weights"))

    def head_logits(self, x_BTD, batch):
        return self.logits(x_BTD, current_exec())

    # ---- direct use ------------------------------------------------------------------------
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
        batch = {"inputs": tokens_BT, **({} if positions_BT is None else
                                          {"positions": positions_BT}),
                 **({} if vis is None else {"vis": vis})}
        with runtime.using(exe=exe):
            x = self.embed(batch)
        x, aux, new_cache = run_stack(self, x, batch, exe, cache)
        logits_BTV = self.logits(x, exe)
        return (logits_BTV, aux) if cache is None else (logits_BTV, aux, new_cache)
