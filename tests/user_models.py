"""Models that are not triax's: a ViT-style image encoder and an MLP-Mixer, written the way a
Flax NNX user writes them, with logical axis names on their parameters
(``nnx.with_partitioning`` on initializers, or ``nnx.Param(..., out_sharding=...)``).

Both are a pre-stack part, a scanned stack of identical blocks (``nnx.vmap`` with
``PARTITION_NAME: "layers"``) and a post-stack part with the loss, so the pipeline can run them.
Shape letters: B batch, P patches (tokens), C pixel values per patch, D embed/channels,
N heads, H head dim, F hidden MLP, K classes, L layers.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from triax.models.axes import constrain

init = nnx.initializers


def part(fn, *names):
    return nnx.with_partitioning(fn, names)


@dataclass(frozen=True)
class VitConfig:
    image: int = 8
    patch: int = 2
    channels: int = 3
    dim: int = 32
    heads: int = 8
    mlp: int = 64
    layers: int = 4
    classes: int = 16

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2

    @property
    def patch_values(self) -> int:
        return self.patch * self.patch * self.channels


def patchify(images_BIIC, patch: int):
    B, I, _, C = images_BIIC.shape
    n = I // patch
    x = images_BIIC.reshape(B, n, patch, n, patch, C).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(B, n * n, patch * patch * C)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, name: str):
        self.scale = nnx.Param(jnp.ones((dim,)), out_sharding=(name,))
        self.bias = nnx.Param(jnp.zeros((dim,)), out_sharding=(name,))

    def __call__(self, x):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        shape = (1,) * (x.ndim - 1) + (-1,)
        return ((x - mu) * jax.lax.rsqrt(var + 1e-6) * self.scale[...].reshape(shape)
                + self.bias[...].reshape(shape))


class StackedClassifier(nnx.Module):
    """What both models share: the pipeline protocol's ``block`` and ``head_loss`` (mean-pool,
    ``norm``, ``head_DK``), and the unpipelined forward over the ``blocks`` stack. Subclasses
    give ``embed``, ``blocks``, ``norm`` and ``head_DK``."""

    @staticmethod
    def block(block, x_BPD, batch):
        return block(x_BPD)

    def head_loss(self, x_BPD, batch):
        """Summed cross-entropy of the batch (the caller divides by the global count)."""
        logits_BK = jnp.einsum("BD,DK->BK", self.norm(x_BPD).mean(1), self.head_DK[...])
        logp = jax.nn.log_softmax(logits_BK, axis=-1)
        return -jnp.take_along_axis(logp, batch["labels"][:, None], axis=-1).sum()

    def __call__(self, batch):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)
        return run(self.embed(batch), self.blocks)


def classifier_loss(model: StackedClassifier, batch):
    return model.head_loss(model(batch), batch) / batch["labels"].shape[0], {}


class VitBlock(nnx.Module):
    """Pre-norm encoder block: Megatron pairs (qkv column-parallel, out row-parallel;
    MLP in column-parallel, out row-parallel) come from the names ``heads`` and ``mlp``."""

    def __init__(self, c: VitConfig, rngs: nnx.Rngs):
        H = c.dim // c.heads
        self.norm1 = LayerNorm(c.dim, "embed")
        self.qkv_D3NH = nnx.Param(part(init.normal(0.02), "embed", None, "heads", "head_dim")(
            rngs.params(), (c.dim, 3, c.heads, H)))
        self.out_NHD = nnx.Param(part(init.normal(0.02), "heads", "head_dim", "embed")(
            rngs.params(), (c.heads, H, c.dim)))
        self.norm2 = LayerNorm(c.dim, "embed")
        self.up = nnx.Linear(c.dim, c.mlp, rngs=rngs,
                             kernel_init=part(init.lecun_normal(), "embed", "mlp"),
                             bias_init=part(init.zeros_init(), "mlp"))
        self.down = nnx.Linear(c.mlp, c.dim, rngs=rngs,
                               kernel_init=part(init.lecun_normal(), "mlp", "embed"),
                               bias_init=part(init.zeros_init(), "embed"))

    def __call__(self, x_BPD):
        q, k, v = jnp.unstack(jnp.einsum("BPD,DINH->IBPNH", self.norm1(x_BPD),
                                         self.qkv_D3NH[...]), axis=0)
        s = jnp.einsum("BPNH,BQNH->BNPQ", q, k) / np.sqrt(q.shape[-1])
        o = jnp.einsum("BNPQ,BQNH->BPNH", jax.nn.softmax(s, axis=-1), v)
        x_BPD = x_BPD + jnp.einsum("BPNH,NHD->BPD", o, self.out_NHD[...])
        h = constrain(jax.nn.gelu(self.up(self.norm2(x_BPD))), ("batch", None, "act_mlp"))
        return constrain(x_BPD + self.down(h), ("batch", None, "act_embed"))


class ViT(StackedClassifier):
    """Image classifier: patch embedding, ``layers`` encoder blocks, mean-pool head."""

    def __init__(self, c: VitConfig, rngs: nnx.Rngs):
        self.c = c
        self.patch_CD = nnx.Param(part(init.lecun_normal(), "pixels", "embed")(
            rngs.params(), (c.patch_values, c.dim)))
        self.pos_PD = nnx.Param(part(init.normal(0.02), None, "embed")(
            rngs.params(), (c.patches, c.dim)))

        @nnx.split_rngs(splits=c.layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return VitBlock(c, rngs)
        self.blocks = make_blocks(rngs)
        self.norm = LayerNorm(c.dim, "embed")
        self.head_DK = nnx.Param(part(init.lecun_normal(), "embed", "classes")(
            rngs.params(), (c.dim, c.classes)))

    # -- the pipeline protocol: pre-stack, one block, post-stack with the loss --------------
    def embed(self, batch):
        x = jnp.einsum("BPC,CD->BPD", patchify(batch["images"], self.c.patch), self.patch_CD[...])
        return constrain(x + self.pos_PD[...][None], ("batch", None, "act_embed"))



vit_loss = classifier_loss


def image_batch(c: VitConfig, batch: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"images": rng.normal(size=(batch, c.image, c.image, c.channels)).astype(np.float32),
            "labels": rng.integers(0, c.classes, (batch,), dtype=np.int32)}


# ---- MLP-Mixer: its own logical names (patch, channels, tokens) ----------------------------
@dataclass(frozen=True)
class MixerConfig:
    image: int = 8
    patch: int = 2
    in_channels: int = 3
    channels: int = 32          # D
    token_mlp: int = 32
    channel_mlp: int = 64
    layers: int = 2
    classes: int = 16

    @property
    def tokens(self) -> int:
        return (self.image // self.patch) ** 2


MIXER_RULES = {"patch": None, "tokens": "embed", "channels": "embed", "token_hidden": "mlp",
               "channel_hidden": "mlp", "classes": None}
"""How the Mixer's names resolve: ``channels`` and ``tokens`` follow the preset's ``embed`` (so
FSDP shards them over data), the hidden widths follow ``mlp`` (tensor under TP), ``patch`` and
``classes`` are replicated."""


class MixerBlock(nnx.Module):
    def __init__(self, c: MixerConfig, rngs: nnx.Rngs):
        self.norm1 = LayerNorm(c.channels, "channels")
        self.tok_in = nnx.Param(part(init.lecun_normal(), "tokens", "token_hidden")(
            rngs.params(), (c.tokens, c.token_mlp)))
        self.tok_out = nnx.Param(part(init.lecun_normal(), "token_hidden", "tokens")(
            rngs.params(), (c.token_mlp, c.tokens)))
        self.norm2 = LayerNorm(c.channels, "channels")
        self.ch_in = nnx.Param(part(init.lecun_normal(), "channels", "channel_hidden")(
            rngs.params(), (c.channels, c.channel_mlp)))
        self.ch_out = nnx.Param(part(init.lecun_normal(), "channel_hidden", "channels")(
            rngs.params(), (c.channel_mlp, c.channels)))

    def __call__(self, x_BPD):
        h = jax.nn.gelu(jnp.einsum("BPD,PF->BFD", self.norm1(x_BPD), self.tok_in[...]))
        x_BPD = x_BPD + jnp.einsum("BFD,FP->BPD", h, self.tok_out[...])
        h = jax.nn.gelu(jnp.einsum("BPD,DF->BPF", self.norm2(x_BPD), self.ch_in[...]))
        return x_BPD + jnp.einsum("BPF,FD->BPD", h, self.ch_out[...])


class Mixer(StackedClassifier):
    def __init__(self, c: MixerConfig, rngs: nnx.Rngs):
        self.c = c
        self.stem = nnx.Param(part(init.lecun_normal(), "patch", "channels")(
            rngs.params(), (c.patch * c.patch * c.in_channels, c.channels)))

        @nnx.split_rngs(splits=c.layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return MixerBlock(c, rngs)
        self.blocks = make_blocks(rngs)
        self.norm = LayerNorm(c.channels, "channels")
        self.head_DK = nnx.Param(part(init.lecun_normal(), "channels", "classes")(
            rngs.params(), (c.channels, c.classes)))

    def embed(self, batch):
        return jnp.einsum("BPC,CD->BPD", patchify(batch["images"], self.c.patch), self.stem[...])



mixer_loss = classifier_loss


def mixer_batch(c: MixerConfig, batch: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"images": rng.normal(size=(batch, c.image, c.image, c.in_channels)).astype(np.float32),
            "labels": rng.integers(0, c.classes, (batch,), dtype=np.int32)}
