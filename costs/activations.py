"""Activations per device: what each block saves for its backward (by remat policy, the
attention kernel or context scheme, MoE's traced residuals), the fp32 logits, a pipeline's
buffers, a forward's working set; head counts split as the layout's rules split them.

    >>> from triax.models import config
    >>> tensor_local("act_heads", 8, 4), tensor_local("act_kv_heads", 2, 4)
    (2, 2)
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from triax.memo_on_disk import on_disk
from triax.models.attention_memory import AttentionMemory, attention_memory, kernel_for
from triax.models.config import ModelConfig
from triax.models.layers import ExecConfig
from triax.models.moe import MoE
from triax.models.transformer import REMAT_POLICIES
from triax.costs.param_layout import layout_rules, local_elements, param_leaves
from triax.costs.pipeline_math import peak_in_flight
from triax.costs.workload import FP32, Layout, Workload, ceil_div
from triax.pipeline import ScheduleKind
from triax.pipeline.buffer_sizes import activation_buffer_bytes
from triax.pipeline.jaxpr_split import reads
from triax.pipeline.pipelined import PipelineConfig
from triax.sharding.context_costs import scheme_memory
from triax.sharding.experts import varying_weight_axes
from triax.sharding.rules import Rules, get_strategy
from triax.choices import PRECISIONS

def tensor_local(logical: str, n: int, tensor: int, rules: Optional[Rules] = None) -> int:
    """``n`` (a head count, an MLP width named ``logical``) on one of ``tensor`` ranks, as
    the layout's ``rules`` place it (``Rules.local_size``; None: the ``tp`` strategy's, for
    a bare tensor degree): split, whole for KV heads that ``tensor`` does not divide
    (replicated), a ShardingError for query heads or a width it does not."""
    rules = get_strategy("tp").rules if rules is None else rules
    return rules.local_size(logical, n, {"tensor": tensor})


def layer_activation_elements(cfg: ModelConfig, tokens: int, seq: int, tensor: int,
                              remat: str, residual_split: int = 1,
                              attention: Optional[float] = None,
                              rules: Optional[Rules] = None) -> float:
    """Elements one block saves for its backward pass, for ``tokens`` tokens on a device.

    No remat: norm inputs/outputs and residuals (~6·D), q/k/v around rope, the kernel's
    operands and the attention output (5·N·H + 3·K·H, whatever the kernel), what the
    attention kernel keeps beyond (``attention``, per token: ``attention_per_token``; None:
    the reference kernel on the whole sequence, its scores and probabilities, 2·N·T;
    ``models.attention_memory``), SwiGLU's fused gate/up, silu, product and its input
    (5·F); TP divides everything but the D-sized terms.
    (Coefficients checked against memory_analysis of tiny and small; see docs/planner.md.)
    MoE: SwiGLU's term is replaced by what ``models.moe`` keeps, traced, not a coefficient
    (:func:`moe_residual_elements`).
    ``full`` keeps only the block input (D); ``dots`` keeps the matmul outputs.
    ``tokens`` are the device's own (under context parallelism T/C of each sequence).
    ``residual_split`` (``residual_split(rules, sizes)``: the tensor degree under sequence
    parallelism, else 1) divides the residual stream's terms: the two residuals, the
    attention and MLP outputs (reduce-scattered), the remat block input; the norm outputs
    are gathered whole for the column-parallel matmuls, which save them.
    ``rules``: the layout's, which say how ``tensor`` splits the heads (:func:`tensor_local`).
    """
    D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    nh = tensor_local("act_heads", N, tensor, rules) * H
    kh = tensor_local("act_kv_heads", K, tensor, rules) * H
    if attention is None:
        attention = attention_memory("reference", queries=seq, keys=seq,
                                     heads=nh // H, kv_heads=kh // H,
                                     head_dim=H, remat=remat).saved / seq
    r = residual_split
    if remat == "full":
        return D / r * tokens
    if cfg.moe is None:
        f = cfg.mlp_dim / tensor
        ffn, ffn_dots = 5 * f, 3 * f
    else:   # what models.moe keeps, traced: its capacity buffers, routing and combine
        ffn = moe_residual_elements(cfg, seq, tensor, "none", rules)
        ffn_dots = (moe_residual_elements(cfg, seq, tensor, remat, rules) if remat != "none"
                    else ffn)
    if remat in ("dots", "dots_no_batch"):
        per_token = 2 * D / r + 2 * nh + 2 * kh + attention + ffn_dots
    else:   # the two norm outputs are gathered for the column-parallel matmuls: whole
        per_token = 2 * D + 4 * D / r + 5 * nh + 3 * kh + attention + ffn
    return per_token * tokens


@functools.lru_cache(maxsize=64)
@on_disk
def moe_residual_elements(cfg: ModelConfig, seq: int, tensor: int, remat: str,
                          rules: Optional[Rules] = None) -> float:
    """Elements per token one MoE layer keeps for its backward on a device: the residuals of
    ``models.moe.MoE``'s ``jax.vjp`` that its pullback reads (XLA drops the rest), less the
    layer's input and weights; traced on abstract shapes (``jax.eval_shape``, nothing is
    allocated), one sequence of ``seq`` tokens, under ``remat``'s checkpoint policy.

    Per capacity slot (E·C/T per token) that is the expert input (D) and SwiGLU's six
    F_e-wide intermediates; per token the top_k routed outputs for the combine (top_k·D), the
    router logits and probabilities (2·E) and the routing indices. The expert FFN's width is
    split over ``tensor`` (the rules' ``expert_mlp``); the token buffers are whole on each
    tensor rank. Under expert parallelism a device's buffers hold its own sequences' slots,
    so the local trace is the device's (the all-to-all moves them, not their size)."""
    moe = cfg.moe
    fe = moe.mlp_dim or cfg.mlp_dim
    width = tensor_local("expert_mlp", fe, tensor, rules)
    local = cfg.replace(moe=dataclasses.replace(moe, mlp_dim=width))
    gd, state = nnx.split(nnx.eval_shape(lambda: MoE(local, nnx.Rngs(0))))
    x = jax.ShapeDtypeStruct((1, seq, cfg.embed_dim), jnp.float32)
    layer = lambda st, x: nnx.merge(gd, st)(x, jnp.float32)  # noqa: E731
    if REMAT_POLICIES[remat] is not None:
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])
    info = {}

    def residuals(st, x):
        out, pullback = jax.vjp(layer, st, x)
        leaves, info["tree"] = jax.tree.flatten(pullback)
        inputs = {id(a) for a in jax.tree.leaves((st, x))}
        info["stored"] = [id(a) not in inputs for a in leaves]
        info["cts"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), out)
        return leaves
    leaves = jax.eval_shape(residuals, state, x)
    read = reads(lambda ls, ct: jax.tree.unflatten(info["tree"], ls)(ct), leaves, info["cts"])
    return sum(math.prod(a.shape) for a, kept, r in zip(leaves, info["stored"], read)
               if kept and r) / seq


def _expert_weight_copies(w: Workload, lay: Layout) -> float:
    """Elements per layer of the expert weights the MoE runner marks per-shard over the
    batch axes besides ``expert`` (``sharding.experts.varying_weight_axes``): a new value per
    layer, which the layer scan keeps for the backward, so each layer's device-local expert
    weights are stored once more. Not under a pipeline (its ``shard_map`` owns those axes)
    nor under remat (the checkpointed layer recomputes them)."""
    rules = lay.strategy.rules
    if w.cfg.moe is None or lay.pipe > 1 or w.remat != "none" \
            or not varying_weight_axes(rules, lay.sizes):
        return 0.0
    whole = layout_rules(w, lay.unsharded_over_data())   # as gathered, under FSDP
    return sum(local_elements(s[1:], l[1:], whole, lay.sizes)
               for p, s, l in param_leaves(w.cfg) if p.startswith("blocks/") and "experts" in l)


def residual_split(rules: Rules, sizes: dict[str, int]) -> int:
    """Pieces one residual-stream activation (``res_seq``) is cut into along the sequence
    beyond the sequence's own split (``seq``, over ``context``): the tensor degree under
    sequence parallelism, else 1."""
    return rules.split_size("res_seq", sizes) // rules.split_size("seq", sizes)


def attention_kernel(w: Workload, lay: Layout) -> str:
    """The attention kernel the step runs (``models.attention_memory.kernel_for``): the
    workload's implementation on its backend; a context-parallel step's local blocks are not
    plain causal, so ``dot_product`` takes XLA's path there, never cuDNN's."""
    context = lay.strategy.rules.split_size("seq", lay.sizes)
    return kernel_for(w.attention, w.backend, PRECISIONS[w.dtype], w.cfg.head_dim,
                      plain_causal=context == 1)


def attention_per_token(w: Workload, lay: Layout, remat: str) -> AttentionMemory:
    """What one layer's attention keeps per local token: the kernel on the whole sequence,
    or under context parallelism the scheme's figures (``sharding.context_costs``)."""
    cfg = w.cfg
    context = lay.strategy.rules.split_size("seq", lay.sizes)
    rules = lay.strategy.rules
    m = scheme_memory(lay.context_attention, attention_kernel(w, lay), seq=w.seq,
                      context=context,
                      heads=tensor_local("act_heads", cfg.num_heads, lay.tensor, rules),
                      kv_heads=tensor_local("act_kv_heads", cfg.num_kv_heads, lay.tensor, rules),
                      head_dim=cfg.head_dim, remat=remat)
    queries = w.seq / context
    return AttentionMemory(m.saved / queries, m.transient / queries)


def activation_bytes(w: Workload, lay: Layout) -> float:
    """Saved activations on the busiest device: its layers × micro-batches in flight, plus
    one block's backward working set (its recomputed or saved internals and their
    gradients, and what its attention holds only while it runs), plus the fp32 logits,
    log-probabilities and their gradient. Under context parallelism every token-wise term
    is the device's T/C tokens of each sequence (the rules split ``seq`` over ``context``).
    """
    cfg = w.cfg
    if cfg is None or not w.train:
        return 0.0 if cfg is None else _inference_activations(w, lay)
    rules = lay.strategy.rules
    local_batch = w.batch / lay.batch_shards
    mb_tokens = local_batch / max(lay.microbatches, 1) * w.seq / rules.split_size("seq",
                                                                                  lay.sizes)
    split = residual_split(rules, lay.sizes)
    attn = attention_per_token(w, lay, "none")
    working = layer_activation_elements(cfg, mb_tokens, w.seq, lay.tensor, "none", split,
                                        attn.saved, rules) + attn.transient * mb_tokens
    logits = logits_bytes(w, lay) / w.dtype_bytes
    if lay.pipe > 1:
        return pipeline_buffer_bytes(w, lay) + (working + logits) * w.dtype_bytes
    in_flight = peak_in_flight(lay.schedule, lay.pipe, lay.microbatches, lay.virtual)
    per_layer = layer_activation_elements(cfg, mb_tokens, w.seq, lay.tensor, w.remat, split,
                                          attention_per_token(w, lay, w.remat).saved, rules)
    saved = cfg.num_layers * (per_layer * in_flight + _expert_weight_copies(w, lay)) + working
    return (saved + logits) * w.dtype_bytes


def loss_tokens(w: Workload, lay: Layout, chunks: Optional[int] = None) -> float:
    """Tokens whose logits are alive at once on a device: its micro-batch's share of the
    sequence, over ``chunks`` (default ``w.loss_chunks``) slices of it (models.loss)."""
    rules = lay.strategy.rules
    rows = w.batch / lay.batch_shards / max(lay.microbatches, 1)
    return rows * w.seq / rules.split_size("seq", lay.sizes) / (chunks or w.loss_chunks)


def logits_bytes(w: Workload, lay: Layout, chunks: Optional[int] = None) -> float:
    """The fp32 logits, log-probabilities and their gradient of ``loss_tokens``, the vocab
    split over ``tensor``. A chunked loss adds the head's weight gradient: the loop carries
    it in fp32 beside each slice's own product, where the whole sequence's loss writes it
    once."""
    chunks = chunks or w.loss_chunks
    head = 0.0 if chunks == 1 else FP32 * w.cfg.embed_dim * w.cfg.vocab_size / lay.tensor
    return 3 * loss_tokens(w, lay, chunks) * w.cfg.vocab_size / lay.tensor * FP32 + head


def pipeline_buffer_bytes(w: Workload, lay: Layout) -> float:
    """The pipeline executor's activation buffers on one stage, asked of the executor
    (``pipeline.buffer_sizes.activation_buffer_bytes``: the schedule's slot counts × the traced
    residual shapes, nothing allocated), and the residual set an op's layer loop
    materialises beside them when a chunk holds several layers (``loop``), and with uneven
    stages the layer slot's conditional's own copy of one layer's (``slot``). The residuals are
    traced whole over ``tensor``; XLA splits them over it as it splits the layer's weights,
    so they are divided by ``tensor`` (the activations passed between stages are not
    split)."""
    sched = lay.schedule or ScheduleKind.ONE_F_ONE_B
    config = PipelineConfig(sched.value, lay.microbatches, lay.virtual,
                            stage_layers=lay.stage_layers)
    rows = ceil_div(w.batch // lay.batch_shards, config.num_microbatches(lay.pipe))
    exe = ExecConfig(PRECISIONS[w.dtype], w.remat)
    buf = activation_buffer_bytes(w.cfg, lay.pipe, config, exe, rows, w.seq)   # cached there
    return (buf["stash"] + buf["loop"] + buf["slot"]) / lay.tensor + buf["inbox"]


def _inference_activations(w: Workload, lay: Layout) -> float:
    """Forward only: one block's working set and the last position's logits."""
    cfg = w.cfg
    tokens = w.batch / lay.batch_shards * w.seq / max(lay.microbatches, 1)
    one = layer_activation_elements(cfg, tokens, w.seq, lay.tensor, "none",
                                    rules=lay.strategy.rules)
    return (one + w.batch / lay.batch_shards * cfg.vocab_size / lay.tensor) * w.dtype_bytes
