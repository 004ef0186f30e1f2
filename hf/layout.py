"""Which Hugging Face tensors make each triax parameter, and how (both directions).

A triax parameter is a stack (over layers, and over experts or the fused gate|up pair) of
Hugging Face tensors, each transposed and reshaped: ``wq_DNH[l] = q_proj.weight.T`` reshaped
``[D, N, H]``, ``w_in_D2F[l, :, 0] = gate_proj.weight.T``. A :class:`Source` says this once;
:func:`read_region` reads any rectangular region of the triax array by slicing only the rows
and columns of the HF tensors it covers, and :func:`hf_tensors` walks the other way for export.

    >>> from triax.models import config
    >>> srcs = {s.path: s for s in sources(config.TINY)}
    >>> s = srcs["blocks/mlp/w_in_D2F"]
    >>> s.hf_name((3, 1)), s.triax_shape
    ('model.layers.3.mlp.up_proj.weight', (4, 64, 2, 128))
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from triax.models.config import ModelConfig


@dataclass(frozen=True)
class Source:
    """One triax parameter assembled from HF tensors.

    ``lead`` are the stacked dimensions (one HF tensor per lead index, named by ``name``);
    ``groups[i]`` are the triax dimensions that HF dimension ``i`` splits into; with
    ``transpose`` the body is the HF tensor's transpose (HF stores ``[out, in]``). The
    assembled array is ``lead + body``; ``perm[j]`` is the triax dimension of assembled
    dimension ``j`` (``w_in_D2F`` keeps its pair dimension between ``D`` and ``F``).
    """

    path: str
    name: Callable[[tuple], str]
    lead: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    transpose: bool = True
    perm: tuple[int, ...] = ()

    @property
    def body(self) -> tuple[int, ...]:
        gs = self.groups[::-1] if self.transpose else self.groups
        return tuple(d for g in gs for d in g)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    @property
    def _perm(self) -> tuple[int, ...]:
        return self.perm or tuple(range(len(self.lead) + len(self.body)))

    @property
    def triax_shape(self) -> tuple[int, ...]:
        assembled = self.lead + self.body
        out = [0] * len(assembled)
        for j, t in enumerate(self._perm):
            out[t] = assembled[j]
        return tuple(out)

    def hf_name(self, lead_index: tuple) -> str:
        return self.name(lead_index)

    def lead_indices(self) -> Iterator[tuple]:
        return itertools.product(*(range(n) for n in self.lead))


def sources(cfg: ModelConfig) -> list[Source]:
    """Every triax parameter of ``cfg`` with its HF tensors (Llama / Mixtral names)."""
    D, N, K, H, F, V, L = (cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.mlp_dim, cfg.vocab_size, cfg.num_layers)

    def layer(suffix: str):
        return lambda i: f"model.layers.{i[0]}.{suffix}"

    out = [
        Source("embed/table_VD", lambda i: "model.embed_tokens.weight", (), ((V,), (D,)),
               transpose=False),
        Source("final_norm/scale", lambda i: "model.norm.weight", (), ((D,),), transpose=False),
        Source("blocks/attn_norm/scale", layer("input_layernorm.weight"), (L,), ((D,),),
               transpose=False),
        Source("blocks/mlp_norm/scale", layer("post_attention_layernorm.weight"), (L,),
               ((D,),), transpose=False),
        Source("blocks/attn/wq_DNH", layer("self_attn.q_proj.weight"), (L,), ((N, H), (D,))),
        Source("blocks/attn/wk_DKH", layer("self_attn.k_proj.weight"), (L,), ((K, H), (D,))),
        Source("blocks/attn/wv_DKH", layer("self_attn.v_proj.weight"), (L,), ((K, H), (D,))),
        Source("blocks/attn/wo_NHD", layer("self_attn.o_proj.weight"), (L,), ((D,), (N, H))),
    ]
    if not cfg.tie_embeddings:
        out.append(Source("head_DV", lambda i: "lm_head.weight", (), ((V,), (D,))))
    if cfg.moe is None:
        pair = ("gate_proj", "up_proj")
        out += [
            Source("blocks/mlp/w_in_D2F", lambda i: f"model.layers.{i[0]}.mlp.{pair[i[1]]}.weight",
                   (L, 2), ((F,), (D,)), perm=(0, 2, 1, 3)),
            Source("blocks/mlp/w_down_FD", layer("mlp.down_proj.weight"), (L,), ((D,), (F,))),
        ]
    else:
        E, Fe = cfg.moe.num_experts, cfg.moe.mlp_dim or F

        def expert(w: str):
            return lambda i: f"model.layers.{i[0]}.block_sparse_moe.experts.{i[1]}.{w}.weight"
        out += [
            Source("blocks/mlp/router_DE", layer("block_sparse_moe.gate.weight"), (L,),
                   ((E,), (D,))),
            Source("blocks/mlp/w_gate_EDF", expert("w1"), (L, E), ((Fe,), (D,))),
            Source("blocks/mlp/w_up_EDF", expert("w3"), (L, E), ((Fe,), (D,))),
            Source("blocks/mlp/w_down_EFD", expert("w2"), (L, E), ((D,), (Fe,))),
        ]
    return out


def _norm(index: Sequence, shape: Sequence[int]) -> list[range]:
    """Slices/ints of a callback index (``make_array_from_callback``) as ranges."""
    out = []
    for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape):
        if isinstance(s, slice):
            start, stop, step = s.indices(n)
            if step != 1:
                raise ValueError(f"strided index {s} is not a shard")
            out.append(range(start, stop))
        else:
            out.append(range(int(s), int(s) + 1))
    return out


def read_region(src: Source, index: Sequence, read: Callable[[str, tuple], np.ndarray]
                ) -> np.ndarray:
    """The triax array's region ``index`` (slices in triax order), reading through
    ``read(hf_name, hf_slices)`` only the HF rows and columns the region covers."""
    ranges = _norm(index, src.triax_shape)
    perm = src._perm
    asm = [ranges[t] for t in perm]                  # ranges in assembled order
    n_lead = len(src.lead)
    lead_r, body_r = asm[:n_lead], asm[n_lead:]
    # body ranges back in HF group order (undo the transpose)
    k = 0
    gs = src.groups[::-1] if src.transpose else src.groups
    per_group = []
    for g in gs:
        per_group.append(body_r[k:k + len(g)])
        k += len(g)
    if src.transpose:
        per_group = per_group[::-1]
    hf_slices, post = [], []
    for g, rs in zip(src.groups, per_group):
        inner = math.prod(g[1:])
        hf_slices.append(slice(rs[0].start * inner, rs[0].stop * inner))
        post.append((len(rs[0]),) + tuple(g[1:]))
    sub = tuple(slice(r.start, r.stop) for rs in per_group for r in rs[1:])

    def body(lead_index):
        x = read(src.hf_name(lead_index), tuple(hf_slices))
        x = x.reshape(tuple(d for p in post for d in p))
        # select the inner dims of each group (the first is already cut by the read)
        idx, k = [], 0
        for p in post:
            idx.append(slice(None))
            idx.extend(sub[k:k + len(p) - 1])
            k += len(p) - 1
        x = x[tuple(idx)]
        if src.transpose:
            split = len(post[0])
            x = np.moveaxis(x, tuple(range(split)), tuple(range(x.ndim - split, x.ndim)))
        return x

    blocks = [body(li) for li in itertools.product(*lead_r)]
    if n_lead:
        out = np.stack(blocks).reshape(tuple(len(r) for r in lead_r) + blocks[0].shape)
    else:
        out = blocks[0]
    return np.transpose(out, np.argsort(perm))


def to_hf(src: Source, body: np.ndarray) -> np.ndarray:
    """One HF tensor from its triax body (the triax array at one lead index)."""
    gs = src.groups[::-1] if src.transpose else src.groups
    x = body.reshape(tuple(math.prod(g) for g in gs))
    return np.ascontiguousarray(x.T if src.transpose else x)


def lead_position(src: Source, lead_index: tuple) -> tuple:
    """Triax index (ints on the lead dims, full slices elsewhere) of one HF tensor."""
    idx: list = [slice(None)] * len(src.triax_shape)
    for j, i in enumerate(lead_index):
        idx[src._perm[j]] = i
    return tuple(idx)
